"""`--task=mqar`: recall accuracy on the MQAR evaluation windows of an MQAR-trained run.

With `--lengths`, the windows are regenerated at each length with the run's number of pairs (the
queries then sit further from their pairs): "by_length" holds the accuracy per length.
"""

from __future__ import annotations

import numpy as np

from nlearn import data
from nlearn.errors import UserError
from nlearn.eval.perplexity import make_evaluator
from nlearn.eval.tasks.context import TaskContext
from nlearn.train.cpu_preset import compiler_options
from nlearn.train.state import make_setup

SAMPLES_KEPT = 8  # windows written to mqar.samples.jsonl per length


def _at_length(config, length: int, examples: int):
    """A copy of `config` whose MQAR evaluation windows have `length` tokens (and `examples` of them)."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.train.seq_len = int(length)
        config.data.mqar.curriculum = ""
        if examples:
            config.data.mqar.eval_examples = int(examples)
        config.data.eval_tokens = 0
    return config


def _samples(batches, length: int) -> list[dict]:
    """The first windows' queried keys and answers (what a reader checks by eye)."""
    out = []
    for batch in batches:
        for inputs, targets, weights in zip(batch["inputs"], batch["targets"], batch["weights"]):
            if len(out) >= SAMPLES_KEPT or not weights.any():
                return out
            answer_at = np.flatnonzero(weights > 0)
            out.append({"length": length, "keys": inputs[answer_at].tolist(), "targets": targets[answer_at].tolist()})
    return out


def run(ctx: TaskContext) -> tuple[dict, list[dict]]:
    if ctx.config.data.source != "mqar":
        raise UserError(f"--task=mqar scores runs trained on data.source='mqar'; this run's source is "
                        f"{ctx.config.data.source!r} (try --task=perplexity)")
    lengths = ctx.lengths or (int(ctx.config.train.seq_len),)
    by_length, samples, first = {}, [], None
    for length in lengths:
        config = _at_length(ctx.config, length, ctx.samples)
        setup = ctx.setup if length == ctx.config.train.seq_len else make_setup(config)
        batches = data.make_eval_batches(config)
        result = make_evaluator(setup, compiler_options(config.train))(ctx.params, batches)
        by_length[str(length)] = result["accuracy"]
        first = first or result
        samples += _samples(batches, length)
    return {"accuracy": first["accuracy"], "loss": first["loss"], "tokens": first["tokens"],
            "by_length": by_length}, samples
