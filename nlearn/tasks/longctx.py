"""What the long-context tasks (niah, babilong) share: checks, greedy answers through the streaming state,
sample records and accuracy tables by variant, length and depth."""

from __future__ import annotations

import collections
import sys
import time
from typing import Iterable

import numpy as np

from nlearn.errors import UserError

PROMPT_CHARS_KEPT = 600  # a long prompt is written to the samples file as its head and tail


def require_tokenizer(ctx, task: str):
    if ctx.tokenizer is None:
        raise UserError(f"--task={task} needs a text tokenizer; this run's data.source {ctx.config.data.source!r} "
                        "is token-only (try --task=mqar or --task=perplexity)")
    return ctx.tokenizer


def depth_grid(count: int) -> list[float]:
    """`count` evenly spaced needle depths in [0, 1] (one: the middle)."""
    if count < 1:
        raise UserError(f"--option=depths must be at least 1, got {count}")
    return [0.5] if count == 1 else [i / (count - 1) for i in range(count)]


def int_option(ctx, name: str, default: int) -> int:
    try:
        return int(ctx.options.get(name, default))
    except ValueError:
        raise UserError(f"--option={name}=... must be an integer, got {ctx.options[name]!r}") from None


def answer(streamer, tokenizer, prompt_ids, max_new_tokens: int) -> tuple[str, bool]:
    """The greedy reply to a prompt, streamed, up to EOS or the end of the line, and whether every logit it
    was decoded from was finite."""
    stops = tuple(i for i in (tokenizer.eos_id, tokenizer.newline_id) if i >= 0)
    ids, finite = streamer.complete([int(i) for i in prompt_ids], max_new_tokens, stops, check_finite=True)
    return tokenizer.decode(ids), finite


def flag_non_finite(result: dict, records: list[dict], task: str) -> None:
    """Count the prompts answered from non-finite logits, by length, into `result["non_finite"]` and warn on
    stderr: a model whose state overflowed at some length scores 0 there, which measures no recall."""
    bad = collections.Counter(r["length"] for r in records if not r["finite"])
    if not bad:
        return
    total = collections.Counter(r["length"] for r in records)
    result["non_finite"] = {str(n): bad[n] for n in sorted(bad)}
    for n in sorted(bad):
        print(f"warning: --task={task}: the logits were not finite for {bad[n]} of {total[n]} prompts at {n} "
              "tokens (the model's state overflowed); those prompts score 0", file=sys.stderr)


def wilson_interval(mean: float, count: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a success rate `mean` over `count` prompts (a prompt's score is 0 or 1
    for one-answer variants; for several answers it treats the mean score as a rate, an approximation)."""
    if count <= 0:
        return 0.0, 1.0
    centre = (mean + z * z / (2 * count)) / (1 + z * z / count)
    half = z * np.sqrt(mean * (1 - mean) / count + z * z / (4 * count * count)) / (1 + z * z / count)
    return float(max(centre - half, 0.0)), float(min(centre + half, 1.0))


def report_length(task: str, variant: str, length: int, scores: list[float], started: float) -> None:
    """One stderr line per (variant, length) swept, so a long sweep shows where it is and how it goes."""
    low, high = wilson_interval(float(np.mean(scores)), len(scores))
    print(f"{task} {variant} at {length} tokens: {len(scores)} prompts, accuracy {100 * np.mean(scores):.0f}% "
          f"(95% interval {100 * low:.0f}-{100 * high:.0f}%; {time.perf_counter() - started:.0f} s)",
          file=sys.stderr, flush=True)


def shorten(text: str, keep: int = PROMPT_CHARS_KEPT) -> str:
    """`text`, or its head and tail around ' [...] ' when longer than `keep` characters."""
    if len(text) <= keep:
        return text
    return text[: keep // 3] + " [...] " + text[-(keep - keep // 3):]


def table(scores: Iterable[tuple[str, int, float, float]]) -> dict:
    """{"accuracy", "by_length", "by_depth", "by_length_depth", "by_variant"} from (variant, length, depth,
    score) tuples; depths as whole percents, every mean over the tuples it covers."""
    scores = list(scores)

    def mean(rows):
        return float(np.mean([r[3] for r in rows])) if rows else 0.0

    def grouped(rows, key):
        groups = collections.defaultdict(list)
        for r in rows:
            groups[key(r)].append(r)
        return {k: mean(v) for k, v in sorted(groups.items(), key=lambda kv: float(kv[0]))}

    def summary(rows):
        by_ld = collections.defaultdict(list)
        for r in rows:
            by_ld[str(r[1])].append(r)
        return {"accuracy": mean(rows), "by_length": grouped(rows, lambda r: str(r[1])),
                "prompts_by_length": {k: len(v) for k, v in sorted(by_ld.items(), key=lambda kv: int(kv[0]))},
                "ci95_by_length": {k: wilson_interval(mean(v), len(v))
                                   for k, v in sorted(by_ld.items(), key=lambda kv: int(kv[0]))},
                "by_depth": grouped(rows, lambda r: str(round(100 * r[2]))),
                "by_length_depth": {k: grouped(v, lambda r: str(round(100 * r[2])))
                                    for k, v in sorted(by_ld.items(), key=lambda kv: int(kv[0]))}}

    variants = list(dict.fromkeys(r[0] for r in scores))
    out = summary(scores)
    out["by_variant"] = {v: summary([r for r in scores if r[0] == v]) for v in variants}
    return out
