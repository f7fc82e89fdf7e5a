"""Validation loss and perplexity over a finite list of weighted batches."""

from __future__ import annotations

import math

import jax

from nlearn import data
from nlearn.train import mesh as mesh_lib
from nlearn.train.step import make_eval_step


def make_evaluator(setup, compiler_options: dict | None = None):
    """`(params, batches) -> {"loss", "perplexity", "accuracy", "tokens"}`, jitted once per setup.

    `accuracy` is the weighted next-token argmax accuracy; a task that names it (`Corpus.accuracy_key`,
    e.g. MQAR's recall on the answers, `mqar_accuracy`) gets it under that name too.
    """
    accuracy_key = data.get_corpus(setup.config).accuracy_key
    step = jax.jit(make_eval_step(setup.graphdef, dtype=setup.dtype),
                   in_shardings=(setup.state_shardings["params"], setup.batch_sharding),
                   compiler_options=compiler_options)
    # a sequence-split mesh: the layers split too; activations stay split as the batch is
    step = mesh_lib.in_mesh_context(step, setup.mesh, setup.batch_sharding)

    def evaluate(params, batches) -> dict:
        total, count, hits = 0.0, 0.0, 0.0
        for batch in batches:
            loss_sum, weight, hit = step(params, setup.put_batch(batch))
            total, count, hits = total + float(loss_sum), count + float(weight), hits + float(hit)
        loss = total / max(count, 1.0)
        result = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
                  "accuracy": hits / max(count, 1.0), "tokens": int(count)}
        if accuracy_key:
            result[accuracy_key] = result["accuracy"]
        return result

    return evaluate
