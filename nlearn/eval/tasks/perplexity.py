"""`--task=perplexity` (the default): validation loss and perplexity, as the trainer's evaluations."""

from __future__ import annotations

import jax

from nlearn import data
from nlearn.eval.perplexity import make_evaluator
from nlearn.eval.tasks.context import TaskContext
from nlearn.train.cpu_preset import compiler_options


def run(ctx: TaskContext) -> tuple[dict, list[dict]]:
    """{"loss", "perplexity", "accuracy", "tokens"} over the run's validation batches; no samples."""
    evaluate = make_evaluator(ctx.setup, compiler_options(ctx.config.train))
    batches = data.make_eval_batches(ctx.config, process_index=jax.process_index(),
                                     process_count=jax.process_count())
    return evaluate(ctx.params, batches), []
