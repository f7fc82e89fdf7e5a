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


def make_train_step(config, graphdef, optimizer, *, dtype=jnp.float32):
    """The one train step: `(state, batch, *schedule) -> (state, metrics)` with every option `config.train`
    sets, so no caller can build a step without one of them.

    The loss is the mean token cross-entropy, or, when the batch carries `weights` (e.g. MQAR, where only
    answers count), the weighted mean over the whole batch; gradients are summed over `train.grad_accum`
    micro-batches. `train.state_passing` starts rows from `state["carry"]` (nlearn.train.state_passing) and
    leaves the batch's final states there (metrics `passed_rows`, `passing_blocked`); `train.write_penalty`
    adds its weight x the memories' write cost (nlearn.train.write_penalty; metric `write_cost`).
    `optimizer` is an optax transformation, or a function of the step's extra `schedule` arguments that
    returns one (a time-budgeted run passes its chosen total as traced scalars, nlearn.train.time_budget).
    """
    t = config.train
    accum = t.grad_accum
    passing = sp.enabled(config)
    axes = sp.batch_axes(config) if passing else None
    costed = wp.enabled(config)
    if passing and accum != 1:
        raise ValueError("train.state_passing needs train.grad_accum=1 (config.validate refuses it)")
    zero = jnp.zeros((), jnp.float32)

    def loss_fn(params, mb, total_weight, penalty, carry, keep_B):
        model = nnx.merge(graphdef, cast_params(params, dtype))
        extra = {}
        if passing:  # the forward is `decode` from each row's start state: the window continues the carried
            b, n = mb["inputs"].shape  # recurrence exactly as streaming would
            fresh = model.init_cache(b, n)
            carry = model.rebase_cache(carry)  # e.g. titans_mac's position, counted from its segment's start
            blocked = ~sp.shared_leaves_agree(carry, fresh, axes)  # e.g. a mini-batch position not back at 0
            keep_B = keep_B & ~blocked
            run, args = model.decode, (mb["inputs"], sp.start_states(carry, fresh, axes, keep_B))
        else:
            run, args = model.__call__, (mb["inputs"],)
        out, cost = wp.run_costed(run, *args) if costed else (run(*args), zero)
        if passing:
            out, extra["final"] = out
            extra["keep"], extra["blocked"] = keep_B, blocked
        loss_sum, _ = weighted_sums(optax.softmax_cross_entropy_with_integer_labels(out, mb["targets"]), mb)
        loss, cost = loss_sum / total_weight, cost / accum
        return (loss + penalty * cost if costed else loss), (loss, cost, extra)

    def train_step(state, batch, *schedule):
        opt = optimizer(*schedule) if callable(optimizer) else optimizer  # an optax transformation is a tuple
        total_weight = jnp.sum(batch["weights"].astype(jnp.float32)) if "weights" in batch else float(
            batch["targets"].size)
        total_weight = jnp.maximum(total_weight, 1.0)
        penalty = wp.weight_at(state["step"], t.write_penalty, t.write_penalty_from) if costed else zero
        carry = state["carry"] if passing else None
        keep_B = (sp.keep_rows(state["rng"], state["step"], batch["inputs"].shape[0], t.state_passing,
                               t.state_passing_from) if passing else None)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum == 1:
            (_, (loss, cost, extra)), grads = grad_fn(state["params"], batch, total_weight, penalty, carry, keep_B)
        else:
            # micro-batch i holds rows i, i + accum, ...: each device's block of rows (the batch is split along
            # B) gives every micro-batch its share, so no micro-batch lives on a few devices only
            micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1),
                                 batch)

            def accumulate(total, mb):
                (_, aux), grads = grad_fn(state["params"], mb, total_weight, penalty, None, None)
                return jax.tree.map(jnp.add, total, (aux, grads)), None

            start = ((zero, zero, {}), jax.tree.map(jnp.zeros_like, state["params"]))
            ((loss, cost, extra), grads), _ = jax.lax.scan(accumulate, start, micro)
        new_state = apply_gradients(opt, state, grads)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if costed:
            metrics["write_cost"] = cost
        if passing:
            new_state["carry"] = sp.next_carry(carry, extra["final"], axes)
            metrics["passed_rows"] = jnp.mean(extra["keep"].astype(jnp.float32))
            metrics["passing_blocked"] = (extra["blocked"] & (state["step"] >= t.state_passing_from)).astype(
                jnp.float32)
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
