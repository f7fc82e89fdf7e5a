"""The pure train and eval steps over `nnx.split` state (jitted by the trainer).

State is a plain pytree `{"params", "opt_state", "step", "rng"}`; the model is rebuilt from
`graphdef` inside the step (`nnx.merge`), as the Flax gemma example does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from nlearn.train import state_passing as sp
from nlearn.train import write_penalty as wp


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


def token_losses_and_write_cost(graphdef, params, inputs_BT, targets_BT, dtype):
    """`token_losses` and the sum over layers of the memories' mean write cost (nlearn.train.write_penalty)."""
    logits, cost = wp.run_costed(nnx.merge(graphdef, cast_params(params, dtype)).__call__, inputs_BT)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT), cost


def weighted_sums(losses_BT, batch):
    """`(sum of losses x weights, sum of weights)`: every token weighs 1 unless the batch carries `weights`."""
    w = batch["weights"].astype(jnp.float32) if "weights" in batch else jnp.ones_like(losses_BT)
    return jnp.sum(losses_BT * w), jnp.sum(w)


def apply_gradients(optimizer, state, grads) -> dict:
    """`state` one optimizer step on: new params, optimizer state and step count."""
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    return dict(state, params=optax.apply_updates(state["params"], updates), opt_state=opt_state,
                step=state["step"] + 1)


def make_train_step(graphdef, optimizer: optax.GradientTransformation, *, grad_accum: int, dtype,
                    state_passing=None, write_penalty=None):
    """`(state, batch) -> (state, metrics)`; gradients averaged over `grad_accum` micro-batches.

    The loss is the mean token cross-entropy, or, when the batch carries `weights` (e.g. MQAR,
    where only answers count), the weighted mean over the whole batch. `state_passing`, when given, is
    `(probability, first step, cache batch axes)`: the step starts rows from `state["carry"]`
    (nlearn.train.state_passing) and leaves the batch's final states there. `write_penalty`, when given, is
    `(weight, first step)`: the loss adds weight x the memories' write cost (nlearn.train.write_penalty),
    reported as the `write_cost` metric.
    """
    if state_passing is not None:
        return _state_passing_step(graphdef, optimizer, dtype, *state_passing, write_penalty=write_penalty)

    def loss_parts(params, mb):
        if write_penalty is None:
            return weighted_sums(token_losses(graphdef, params, mb["inputs"], mb["targets"], dtype), mb), 0.0
        losses, cost = token_losses_and_write_cost(graphdef, params, mb["inputs"], mb["targets"], dtype)
        return weighted_sums(losses, mb), cost

    def train_step(state, batch):
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)
        total_weight = jnp.sum(batch["weights"].astype(jnp.float32)) if "weights" in batch else float(
            batch["targets"].size)
        total_weight = jnp.maximum(total_weight, 1.0)
        penalty = 0.0 if write_penalty is None else wp.weight_at(state["step"], *write_penalty)

        def loss_fn(params, mb):
            (loss_sum, _), cost = loss_parts(params, mb)
            loss = loss_sum / total_weight
            return loss + penalty * cost / grad_accum, (loss, cost / grad_accum)

        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if grad_accum == 1:
            (_, (loss, cost)), grads = grad_fn(state["params"], batch)
        else:
            def accumulate(carry, mb):
                return jax.tree.map(jnp.add, carry, grad_fn(state["params"], mb)), None

            nothing = jnp.zeros((), jnp.float32)
            zero = ((nothing, (nothing, nothing)), jax.tree.map(jnp.zeros_like, state["params"]))
            ((_, (loss, cost)), grads), _ = jax.lax.scan(accumulate, zero, micro)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if write_penalty is not None:
            metrics["write_cost"] = cost
        return apply_gradients(optimizer, state, grads), metrics

    return train_step


def _state_passing_step(graphdef, optimizer, dtype, probability: float, first_step: int, axes, *,
                        write_penalty=None):
    """The train step of `train.state_passing` (one micro-batch): the forward is the model's `decode` from
    each row's start state, so the window continues the carried recurrence exactly as streaming would."""

    def loss_fn(params, batch, carry, keep_B, penalty):
        model = nnx.merge(graphdef, cast_params(params, dtype))
        b, t = batch["inputs"].shape
        fresh = model.init_cache(b, t)
        carry = model.rebase_cache(carry)  # e.g. titans_mac's position, counted from its segment's start
        blocked = ~sp.shared_leaves_agree(carry, fresh, axes)  # e.g. a mini-batch position not back at 0
        keep_B = keep_B & ~blocked
        start = sp.start_states(carry, fresh, axes, keep_B)
        if write_penalty is None:
            (logits, final), cost = model.decode(batch["inputs"], start), 0.0
        else:
            (logits, final), cost = wp.run_costed(model.decode, batch["inputs"], start)
        loss_sum, weight = weighted_sums(
            optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), batch)
        loss = loss_sum / jnp.maximum(weight, 1.0)
        return loss + penalty * cost, (loss, cost, final, keep_B, blocked)

    def train_step(state, batch):
        keep_B = sp.keep_rows(state["rng"], state["step"], batch["inputs"].shape[0], probability, first_step)
        penalty = 0.0 if write_penalty is None else wp.weight_at(state["step"], *write_penalty)
        (_, (loss, cost, final, keep_B, blocked)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], batch, state["carry"], keep_B, penalty)
        new_state = dict(apply_gradients(optimizer, state, grads), carry=sp.next_carry(state["carry"], final, axes))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "passed_rows": jnp.mean(keep_B.astype(jnp.float32)),
                   "passing_blocked": (blocked & (state["step"] >= first_step)).astype(jnp.float32)}
        if write_penalty is not None:
            metrics["write_cost"] = cost
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, *, dtype):
    """`(params, batch) -> (weighted loss sum, weight sum, weighted count of argmax hits)`."""

    def eval_step(params, batch):
        logits = logits_of(graphdef, params, batch["inputs"], dtype)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        hits = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
        w = batch["weights"].astype(jnp.float32)
        losses = jnp.where(w > 0, losses, 0.0)  # padding never contributes, even if not finite
        return jnp.sum(losses * w), jnp.sum(w), jnp.sum(hits * w)

    return eval_step
