"""MQAR curriculum: train first on shorter, easier windows, then on the task itself.

`data.mqar.curriculum = "64x4:300"` trains the first 300 steps on windows of 64 tokens with 4
key-value pairs, then on the configured task (train.seq_len, data.mqar.num_pairs). Stages are
comma-separated and run in order ("64x4:200,128x8:200"). Every stage keeps the tokens per step
of the task: a stage of length L uses batch_size * seq_len / L rows. Zoology trains MQAR on such
a mixture of lengths (most examples 64 tokens with 4 pairs); here the short windows come first
because a model learns the recall mechanism there in a fraction of the steps (deltanet: ~200
steps at 64x4 against 400-1100 at 256x16) and the long windows then only have to extend it.
Evaluation always uses the task's own windows.

The MQAR source hands the stages to the pipeline (`Corpus.stages`, see `training_stages`), which
trains on them through the same staged iterator as any other source's stages (nlearn.data.staged).

A stage may also say where its queries start: "128x4@64:150" is 150 steps of 128-token windows
whose 4 pairs end at position 64 (filler before them) and whose queries all come from there on.
A model that attends within 64-token segments (titans_mac) can answer those only from its
memory, so such a stage trains the memory before attention learns to answer from nearby pairs
(data.mqar.query_start).
"""

from __future__ import annotations

import dataclasses
import re

import ml_collections

from nlearn.errors import UserError

_STAGE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?:@\s*(\d+)\s*)?:\s*(\d+)\s*$")


@dataclasses.dataclass(frozen=True)
class Stage:
    seq_len: int
    num_pairs: int
    steps: int
    query_start: int = 0  # where the pairs end and the queries start; 0: the pairs at the start


def parse_curriculum(spec: str, seq_len: int) -> list[Stage]:
    """'LxP:S,...' -> stages; UserError naming data.mqar.curriculum on any malformed part."""
    stages = []
    for part in [p for p in str(spec).split(",") if p.strip()]:
        m = _STAGE.match(part)
        if not m:
            raise UserError(f"data.mqar.curriculum: cannot read stage {part.strip()!r}; expected "
                            f"'LENxPAIRS:STEPS' or 'LENxPAIRS@QUERY_START:STEPS' stages separated "
                            f"by commas, e.g. '64x4:300' or '128x4@64:150,64x4:100'")
        length, pairs, start, steps = (int(g or 0) for g in m.groups())
        stage = Stage(length, pairs, steps, start)
        if stage.seq_len < 1 or seq_len % stage.seq_len:
            raise UserError(f"data.mqar.curriculum: stage length {stage.seq_len} must divide "
                            f"train.seq_len={seq_len} (each stage keeps the tokens per step)")
        if 4 * stage.num_pairs > stage.seq_len or stage.num_pairs < 1:
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs 1 <= pairs <= "
                            f"length / 4 (the pairs, then one query slot per pair)")
        if stage.query_start and not (2 * stage.num_pairs <= stage.query_start
                                      <= stage.seq_len - 2 * stage.num_pairs):
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs 2 * pairs <= query "
                            f"start <= length - 2 * pairs (the pairs, then one query slot per pair)")
        if stage.steps < 1:
            raise UserError(f"data.mqar.curriculum: stage {part.strip()!r} needs at least 1 step")
        stages.append(stage)
    return stages


def resized_windows(config: ml_collections.ConfigDict, seq_len: int) -> ml_collections.ConfigDict:
    """A copy of config that trains on windows of seq_len tokens at the same tokens per step."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.train.batch_size = int(config.train.batch_size) * (int(config.train.seq_len) // seq_len)
    c.train.seq_len = seq_len
    return c


def stage_config(config: ml_collections.ConfigDict, seq_len: int, num_pairs: int,
                 query_start: int = 0) -> ml_collections.ConfigDict:
    """The config of one stage (no curriculum of its own): windows of seq_len tokens with
    num_pairs pairs and queries from query_start, at the tokens per step of config."""
    c = resized_windows(config, seq_len)
    c.data.mqar.num_pairs = num_pairs
    c.data.mqar.query_start = query_start
    c.data.mqar.curriculum = ""
    return c


def training_stages(config: ml_collections.ConfigDict) -> tuple:
    """`((steps, stage config), ...)` of `data.mqar.curriculum`, for `Corpus.stages`."""
    m, seq_len = config.data.mqar, int(config.train.seq_len)
    return tuple((s.steps, stage_config(config, s.seq_len, s.num_pairs, s.query_start))
                 for s in parse_curriculum(m.curriculum, seq_len))
