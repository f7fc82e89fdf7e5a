"""`--task=babilong`: bAbI qa1-qa3 stories scattered through held-out corpus text at the requested lengths,
greedy replies through the streaming state, BABILong's compare_answers (nlearn.tasks.babilong).

`--variant` picks qa1, qa2, qa3, a comma list, or all (default); `--lengths` the prompt lengths in tokens
(reply included; default train.seq_len); `--samples` stories per task and length (default 20);
`--option=max_new_tokens=N` the reply budget (default 8).
"""

from __future__ import annotations

import time

import numpy as np

from nlearn.tasks import haystack

from nlearn.tasks.babilong import data as babilong
from nlearn.tasks import longctx
from nlearn.eval.streaming import streamer_for
from nlearn.eval.tasks.context import TaskContext

DEFAULT_SAMPLES = 20
EVAL_STREAM = 2


def run(ctx: TaskContext) -> tuple[dict, list[dict]]:
    tokenizer = longctx.require_tokenizer(ctx, "babilong")
    tasks = babilong.parse_tasks(ctx.variant or "all", key="--variant")
    lengths = ctx.lengths or (int(ctx.config.train.seq_len),)
    samples = ctx.samples or DEFAULT_SAMPLES
    max_new = longctx.int_option(ctx, "max_new_tokens", 8)
    words = haystack.haystack_words(ctx.config, "validation")
    streamer = streamer_for(ctx)
    scores, records = [], []
    for ti, task in enumerate(tasks):
        for length in lengths:
            started = time.perf_counter()
            for j in range(samples):
                rng = np.random.default_rng([babilong.SEED_TAG, EVAL_STREAM, ctx.seed, ti, length, j])
                ex = babilong.babilong_example(rng, task, tokenizer, length, words)
                reply, finite = longctx.answer(streamer, tokenizer, ex["prompt_ids"], max_new)
                score = float(finite and babilong.compare_answers(ex["target"], reply, ex["question"],
                                                                  babilong.TASK_LABELS[task]))
                scores.append((task, length, 0.5, score))
                records.append({"variant": task, "length": length, "prompt_tokens": len(ex["prompt_ids"]),
                                "facts": ex["facts"], "question": ex["question"],
                                "input": longctx.shorten(ex["prompt"]), "targets": [ex["target"]], "output": reply,
                                "finite": finite, "score": score})
            longctx.report_length("babilong", task, length, [r[3] for r in scores[-samples:]], started)
    result = longctx.table(scores)
    for summary in [result, *result["by_variant"].values()]:
        del summary["by_depth"], summary["by_length_depth"]  # the facts are scattered: no single depth
    longctx.flag_non_finite(result, records, "babilong")
    result["scoring"] = "BABILong compare_answers (the target is the only task label in the reply's first sentence)"
    return result, records
