"""Validation loss and perplexity over a finite list of weighted batches."""

from __future__ import annotations

import math

import jax

from nlearn.train.step import make_eval_step


def make_evaluator(setup):
    """`(params, batches) -> {"loss", "perplexity", "tokens"}`, jitted once per setup."""
    step = jax.jit(make_eval_step(setup.graphdef, dtype=setup.dtype),
                   in_shardings=(setup.state_shardings["params"], setup.batch_sharding))

    def evaluate(params, batches) -> dict:
        total, count = 0.0, 0.0
        for batch in batches:
            loss_sum, weight = step(params, setup.put_batch(batch))
            total += float(loss_sum)
            count += float(weight)
        loss = total / max(count, 1.0)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": int(count)}

    return evaluate
