"""The pure train and eval steps over `nnx.split` state (jitted by the trainer).

State is a plain pytree `{"params", "opt_state", "step", "rng"}`; the model is rebuilt from
`graphdef` inside the step (`nnx.merge`), as the Flax gemma example does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def cast_params(params, dtype):
    """Compute-dtype copy of float32 params (bf16 compute keeps float32 master weights)."""
    if dtype == jnp.float32:
        return params
    return jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)


def logits_of(graphdef, params, inputs_BT, dtype):
    """float32 logits `[B, T, V]` of the model rebuilt from `graphdef` and `params`."""
    return nnx.merge(graphdef, cast_params(params, dtype))(inputs_BT)


def token_losses(graphdef, params, inputs_BT, targets_BT, dtype):
    """Per-token cross-entropy `[B, T]` (float32 logits)."""
    logits = logits_of(graphdef, params, inputs_BT, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, grad_accum: int, dtype):
    """`(state, batch) -> (state, metrics)`; gradients averaged over `grad_accum` micro-batches."""

    def loss_fn(params, inputs, targets):
        return jnp.mean(token_losses(graphdef, params, inputs, targets, dtype))

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state, batch):
        inputs, targets = batch["inputs"], batch["targets"]
        if grad_accum == 1:
            loss, grads = grad_fn(state["params"], inputs, targets)
        else:
            micro = lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:])

            def accumulate(carry, mb):
                loss, grads = grad_fn(state["params"], *mb)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
            (loss, grads), _ = jax.lax.scan(accumulate, zero, (micro(inputs), micro(targets)))
            loss, grads = jax.tree.map(lambda x: x / grad_accum, (loss, grads))
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        new_state = dict(state, params=params, opt_state=opt_state, step=state["step"] + 1)
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, *, dtype):
    """`(params, batch) -> (weighted loss sum, weight sum, weighted count of argmax hits)`."""

    def eval_step(params, batch):
        logits = logits_of(graphdef, params, batch["inputs"], dtype)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        hits = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
        w = batch["weights"].astype(jnp.float32)
        return jnp.sum(losses * w), jnp.sum(w), jnp.sum(hits * w)

    return eval_step
