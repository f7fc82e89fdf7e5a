"""`--task=niah`: RULER needle-in-a-haystack at the requested lengths, needles at evenly spaced depths,
greedy decoding through the streaming state, RULER's string_match_all score (nlearn.tasks.niah).

`--variant` picks single_1 (default), ..., multiquery, a comma list, or all; `--lengths` the prompt lengths
in tokens (RULER's 128 reply tokens included, as it counts them; default train.seq_len); `--samples` prompts
per variant and length (default 100; the JSON gives each length's 95% interval); `--option=depths=N` the
depth grid (default 5: 0, 25, 50, 75, 100% of the haystack's units, 100% meaning before the last one);
evaluation keys come from held-out words, so none was seen in training;
`--option=max_new_tokens=N` the reply budget (default: the answer's tokens + 4). Besides RULER's score, the
JSON's `by_length_char` gives, for one-answer prompts, the fraction of replies right at each character of the
value (which digits are lost with length).
"""

from __future__ import annotations

import time

import numpy as np

from nlearn.tasks import haystack

from nlearn.tasks.niah import data as niah
from nlearn.tasks import longctx
from nlearn.eval.streaming import streamer_for
from nlearn.eval.tasks.context import TaskContext

DEFAULT_SAMPLES = 100  # prompts per variant and length: a 95% interval of about +-10 points at worst
EVAL_STREAM = 2  # seed stream apart from the training (0) and validation (1) windows


def run(ctx: TaskContext) -> tuple[dict, list[dict]]:
    tokenizer = longctx.require_tokenizer(ctx, "niah")
    names = niah.parse_variants(ctx.variant or "single_1", key="--variant")
    lengths = ctx.lengths or (int(ctx.config.train.seq_len),)
    samples = ctx.samples or DEFAULT_SAMPLES
    depths = longctx.depth_grid(longctx.int_option(ctx, "depths", 5))
    max_new = longctx.int_option(ctx, "max_new_tokens", 0)
    needs_essay = any(niah.VARIANTS[n].haystack == "essay" for n in names)
    words = haystack.haystack_words(ctx.config, "validation") if needs_essay else ()
    streamer = streamer_for(ctx)
    scores, records = [], []
    for vi, name in enumerate(names):
        variant = niah.VARIANTS[name]
        for length in lengths:
            started = time.perf_counter()
            for j in range(samples):
                rng = np.random.default_rng([niah.SEED_TAG, EVAL_STREAM, ctx.seed, vi, length, j])
                depth = depths[j % len(depths)]
                ex = niah.niah_example(rng, variant, tokenizer, length, depth, words, evaluation=True)
                reply, finite = longctx.answer(streamer, tokenizer, ex["prompt_ids"],
                                               max_new or len(ex["answer_ids"]) + 4)
                score = niah.string_match_all(reply, ex["answers"]) if finite else 0.0
                scores.append((name, length, depth, score))
                records.append({"variant": name, "length": length, "depth": round(100 * depth),
                                "prompt_tokens": len(ex["prompt_ids"]), "input": longctx.shorten(ex["prompt"]),
                                "targets": ex["answers"], "output": reply, "finite": finite, "score": score})
            longctx.report_length("niah", name, length, [r[3] for r in scores[-samples:]], started)
    result = longctx.table(scores)
    result["by_length_char"] = char_accuracy(records)
    longctx.flag_non_finite(result, records, "niah")
    result["scoring"] = "RULER string_match_all (case-insensitive substring, mean over the answers)"
    return result, records


def char_accuracy(records: list[dict]) -> dict[str, list[float]]:
    """{length: [fraction of one-answer replies right at character i of the answer]}, the answers of one length
    being equally long (RULER's values are); lengths with none or mixed answer lengths are left out."""
    by_length: dict[int, list[list[bool]]] = {}
    for r in records:
        if len(r["targets"]) == 1:
            by_length.setdefault(r["length"], []).append(niah.char_matches(r["output"], r["targets"][0]))
    return {str(length): [round(float(x), 4) for x in np.mean(rows, axis=0)]
            for length, rows in by_length.items() if len({len(row) for row in rows}) == 1}
