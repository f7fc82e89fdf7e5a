"""MQAR (multi-query associative recall, Zoology) for any family: `configs/mqar.py:<family>`.

One common task and budget for every family: T=256 tokens holding 16 key-value pairs then their
queries, loss only on the answers, 2 layers, d_model=128, trained for BUDGET["steps"] steps, the
first CURRICULUM steps on shorter windows with fewer pairs (Zoology-style; evaluation is always on
the task itself). FAMILY_OVERRIDES and FAMILY_TRAINING hold the few per-family departures, each
with its reason; `make mqar` prints them above its table.
`make mqar` (scripts/mqar.py) also stops a run at TIME_LIMIT_S of wall time (the trainer saves a
checkpoint on SIGTERM, which is then scored), so every family trains for at most 10 minutes.

  nlearn-train --config=configs/mqar.py:deltanet --workdir=runs/mqar-deltanet
  nlearn-eval --workdir=runs/mqar-deltanet      # reports mqar_accuracy

The vocabulary is 512 (keys from [1, 256), values from [256, 512)) rather than Zoology's 8192:
recall is as hard, but the output layer costs 16x less. Family sizes come from
`configs/<family>.py:tiny`; the dimensions below override them. No weight decay (the task has
no noise to regularise against) and a short warmup: MQAR is learnt after a loss plateau at
ln(256), and the steps spent on the plateau are what the budget has to cover.
TASK["random_filler"] (or --config.data.mqar.random_filler=True) fills the query region with
random non-key tokens instead of 0, as Zoology's random_non_queries does; the presets keep 0.
"""

import importlib.util
import os

TASK = dict(seq_len=256, num_pairs=16, vocab_size=512, eval_examples=1000, random_filler=False)
# SwiGLU width 128 (not the default 384): the recall is done by the mixers, and the narrower MLP
# makes a step ~1.4x cheaper.
MODEL = dict(d_model=128, num_layers=2, num_heads=2, mlp_dim=128)
# 1300 steps of 16, cosine to 0.1x: with the curriculum below the recall is learnt by step ~400,
# so a decaying lr no longer starves a late break-out (without it, the plateau lasted 400-1100
# steps and the presets kept the lr constant); the decay then polishes the last percent
# (over 1200 steps: deltanet 99.1% at step 900, 99.5% at 1000; titans_lmm 97.5% at 900, 98.5% at
# 1200, hence 1300). ~9 minutes on 2 idle cores for titans_lmm (~10k tokens/s).
# XLA:CPU's fast-compile preset: each window shape compiles 1-4 s sooner and the steps ran as fast or
# faster (interleaved in one process: titans_mac 692 against 744 ms, deltanet 339 against 367 ms,
# titans_lmm and transformer within noise).
BUDGET = dict(batch_size=16, steps=1300, lr=3e-3, schedule="cosine", min_lr_ratio=0.1, warmup_steps=20,
              weight_decay=0.0, cpu_opt_preset="fast_compile")
# Curriculum (data.mqar.curriculum, Zoology-style easy windows first): the first steps train on
# 64-token windows with 4 pairs at the same tokens per step, where the recall mechanism is learnt
# in ~200-300 steps; on the task itself the plateau lasted 400-1100 steps. Evaluation is on the
# task (T=256, 16 pairs) only.
CURRICULUM = "64x4:300"
TIME_LIMIT_S = 600  # wall-time cap per family in `make mqar` (start-up and compilation included, scoring not)
# Per-family model overrides (listed in results/mqar.md by scripts/mqar.py). The Titans
# families use a linear memory (depth 1): at these shapes a depth-2 memory (64->256->64) costs
# ~11x more per token on CPU (0.50 s against 0.045 s per layer and step, fwd+bwd), which leaves
# too few steps within 10 minutes. Its inner learning rate may reach 0.2 (max_lr; the LM default
# for depth 1 is 0.04): a key seen once must be written strongly enough to be recalled ~200 tokens
# later. titans_lmm with the curriculum: 56% at step 400 and 98.5% at 1200 with 0.2, against 10%
# and 94.1% with 0.04; 0.5 and 1.0 left the first stage's plateau later than 0.2.
# titans_mac's forgetting gate starts at alpha = 1e-3 per token (memory.decay_init; the default
# sigmoid(-4) ~ 0.018 keeps e^-3.6 ~ 3% of a write 200 tokens on, so the recall across segments
# waits until the gate has learnt to keep; trained, its median alpha was ~5e-4 in the first
# layer). One core each, 256 examples, the preset otherwise: seeds 0 / 1 92.2% / 96.4% at step
# 700 and 99.3% / 99.4% at 1300, against 86.6% / 94.4% and 98.3% / 98.7% with the default.
# titans_lmm keeps the default: on two cores seeds 0 / 1 gave 99.2% / 98.7% with it, 98.2% / 99.3% with 1e-3
# (1600 steps instead of 1300: seed 1 98.7% again).
# Those figures are the paper's summed step (memory.inner_step=paper). With the bounded default step the
# depth-1 default max_lr is 1.0 and no override is needed for stability; MQAR with it is not yet measured.
FAMILY_OVERRIDES: dict[str, dict] = {
    "titans_lmm": {"memory.depth": 1},  # depth 1: for speed (see above)
    "titans_mac": {"memory.depth": 1, "memory.decay_init": 1e-3},
    # The strongest writes the op allows (lr_max 1.0, lr_t ~ 0.9 at first; the LM default starts at 0.05) and
    # little forgetting (retain 0.999: ~78% of a write left 250 tokens on, against 8% with the LM default 0.99),
    # as titans_lmm's max_lr and titans_mac's decay_init. With HOPE.md's targets and steps, runs became nan at
    # step ~160: the fast weights grew ~10x per 16-token chunk, hidden by the output RMSNorm until they
    # overflowed. Fixed targets (targets="initial"), DGD on the output layers and normalised inner steps keep
    # them bounded. read_residual=False: the read M(q) = q + act(q W_in) W_out is mostly the unit query q
    # itself, which swamps the recall (with the skip: 0.5-0.7%). With lr_max = lr_init = 0.5 a trained model's
    # write removed a median 0.5% of its error (the normalised output step is lr |h|^2 / (1 + |h|^2) with
    # |h|^2 ~ 0.1) and seeds 0 / 1 / 2 reached 11.2 / 12.5 / 18.8% at step 1000; with 1.0 / 0.9, 5-8% per write
    # and 97.0 / 97.6 / 80.7% (median 97.0%; one core each, 1000 steps). results/history.md, 2026-12-02.
    "self_ref_titans": {"memory.lr_max": 1.0, "memory.lr_init": 0.9, "memory.retain_init": 0.999,
                        "memory.targets": "initial", "memory.dgd_output": True,
                        "memory.read_residual": False},
    # Hope-Attention (causal attention, then the CMS levels learning in context): Hope's own mixer is the
    # self-referential op above, whose MQAR runs became nan; the CMS is what this row adds.
    "hope": {"hope.mixer": "attention"},
}
# Per-family training overrides (paths from the config root), for a family the common recipe does
# not fit. titans_mac attends within 64-token segments, so the common 64-token windows are answered
# by its attention alone and never train its memory (the recall across segments); a second stage of
# 128-token windows (two segments) does. Trial runs (1300-step cosine, 256 examples): with
# "64x4:300" 44% / 68% / 87% at steps 300 / 500 / 600, but another seed and four variants (inner
# dgd, no momentum, inner mini-batch 8, outer lr 6e-3) stayed at ~48% through step 600 (the first
# segment's answers only); with "64x4:150,128x8:150" 39% / 92% / 96%, and 99.1% at step 1100.
# Its steps cost ~1.6x titans_lmm's, so 10 minutes hold ~700-760 of them: a cosine ending there decays
# the lr before the recall is learnt (91.9% at 720), one over 1300 steps is cut at ~60% of its
# peak (96.8% at 701); warmup-stable-decay over 700 steps (the peak until step 350, then linear
# to 0.1x) ends decayed within the limit: 98.1-98.3% at step 700 in trials (256 examples; 98.5%
# at 740; decaying over the last 25% instead of 50%, to 0 instead of 0.1x: the same within 0.2%;
# peak lr 4e-3: 94.9% at 600 against 96.9%). 760 steps since the train step stopped compiling twice
# per window shape (~12 s each) and MAC's segment loop is unrolled (98.6% at step 751 of 760 in `make mqar`,
# where the time limit stopped it). 790 since the short convs' hand-written backward and XLA's
# fast-compile preset (~8% more tokens/s, a few seconds less compilation per shape): a trial over
# 820 steps reached 99.3% but finished training ~12 s past the limit; `make mqar` with 790: 99.3% in 9.7
# minutes. Fragile: from initial parameters differing by <= 7e-9 (rounding), the same preset ended at 62.7%.
# Over seeds (full 790-step runs, one core each, 256 examples; README): seeds 1 / 2 / 4 97.8% / 99.1% /
# 98.8%; "64x4:100,128x8:200" seeds 1 / 3 / 4 98.0% / 99.5% / 99.2%, seed 0 in `make mqar` 98.2%. The
# break-out comes in every seed tried, but the slower seeds are still polishing at step 790: about half
# the runs pass 99% within 10 minutes (seed 1 with the WSD over 900 / 1000 steps: 98.6% / 99.5%).
# On a faster CPU (a later session; other rounding) the same recipe missed on seeds 0 and 1 (~87% at
# step 700; on the plateau near 50%), and so did WSD over 1100 steps (92.8% / 74.8%), a 128x4 second
# stage, weight decay 0.1 and seven other variants (README): the break-out itself is chaotic here.
# train.time_budget_s (nlearn.train.budget): on a machine slower than the one that set 790, the run
# lowers its total at step ~310 (while the WSD is still at its peak) so it ends decayed within 570 s of
# its start, instead of being stopped at the 10-minute limit at its peak lr. A faster machine trains all
# 790: longer schedules did not pass more often (README, "How often the preset passes 99%").
# Since 2026-11-30 MAC's memory learns from the segment's tokens x, not x + y (model.mac_memory_input,
# configs/titans_mac.py): with y in its input the memory learnt recall across segments far more slowly
# (loss 5.43 against 3.70 at step 200 on windows where every answer needs it). Pinned to one core,
# 256 examples: seed 1 95.9% at 790 (x + y: the ~50% plateau), seed 0 88.6% (x + y: 87.3% at 700).
# Curricula whose windows force every answer through the memory ("128x4@64", "64x4@16" with
# 16-token segments, nlearn.data.curriculum) and 16-token segments did worse (README). With the memory
# learning faster, the same WSD over 1300 steps broke out on both seeds and polished further: 98.3% / 98.7%
# at step 1300 (seeds 0 / 1; 91.6% / 95.9% at 800); titans_lmm's "64x4:300" left seed 1 on the plateau.
# 1300 steps take ~7 minutes on this repo's current 2-core machine; where they do not fit, the time
# budget lowers the total (to ~800 on the slower machine that set 790). On two cores, as `make mqar` runs
# it: seeds 0-4 99.3% / 60.7% / 99.1% / 99.2% / 99.4% (seed 1 on the ~50% plateau from step 400 to 700):
# better than the old design's 0 of 3 here, still not reliable. "64x4:150,128x8:300": seeds 1 / 2 98.9% / 98.7%.
# Since 2026-12-01 the forgetting gate starts at 1e-3 (FAMILY_OVERRIDES) and the two-segment stage lasts
# 300 steps: with the 150-step stage and the new gate, seed 0 on two cores left the plateau only at
# step ~700 (95.8%), and the longer stage gave seeds 0-4 99.1% / 99.2% / 98.8% / 99.2% / 99.7% (two cores,
# 6.3-6.8 minutes each; seed 2 left the plateau early, its errors are spread over the later segments: the
# memory's precision). 1600 steps (WSD, decaying from 800) polish further: seeds 0 / 1 / 2 99.7% /
# 99.5% / 99.0% (8.1-8.2 minutes each); where 1600 do not fit, train.time_budget_s lowers the total.
# self_ref_titans: 1000 steps (WSD, decaying from step 500), which its seeds need (median 97.0%, above), took
# 24 minutes on one core (~16 expected on two idle cores, where 617 took 10.2): its step costs ~2.5x
# titans_lmm's (pinned to one core, interleaved: 2.7x at 64 tokens, 2.35x at 256). Within `make mqar`'s 10
# minutes on two idle cores the time budget lowered the total to 617 steps: 49.0% (2026-12-02). So it has
# its own wall-time cap (FAMILY_TIME_LIMIT_S), and train.time_budget_s lowers the total only where even that
# does not hold 1000.
FAMILY_TRAINING: dict[str, dict] = {
    "titans_mac": {"data.mqar.curriculum": "64x4:150,128x8:300", "train.steps": 1600,
                   "train.schedule": "wsd", "train.decay_fraction": 0.5, "train.time_budget_s": 570.0},
    "self_ref_titans": {"train.steps": 1000, "train.schedule": "wsd", "train.decay_fraction": 0.5,
                        "train.time_budget_s": 1770.0},
    # Hope's two-pass step (pass 1 walks the window in 16-token chunks) costs more than a plain step: the
    # time budget lowers the WSD total so the run ends decayed within the limit.
    "hope": {"train.schedule": "wsd", "train.decay_fraction": 0.5, "train.time_budget_s": 570.0},
}
# Per-family wall-time caps of `make mqar` (seconds) where a preset needs more than TIME_LIMIT_S (why: above).
FAMILY_TIME_LIMIT_S: dict[str, float] = {"self_ref_titans": 1800.0}


def _set(node, key: str, value) -> None:
    """Set an existing dotted key (a typo must not add a new one)."""
    *path, name = key.split(".")
    for part in path:
        node = node[part]
    if name not in node:
        raise KeyError(f"configs/mqar.py override {key!r}: no such config key")
    node[name] = value


TASK_CONFIGS = ("mqar", "niah")  # configs/ files that are tasks over every family, not families


def family_base(family: str):
    """`configs/<family>.py:tiny`, loaded by path (configs/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{family}.py")
    if not os.path.exists(path) or family in TASK_CONFIGS:
        from nlearn.errors import UserError

        families = sorted(f[:-3] for f in os.listdir(os.path.dirname(path))
                          if f.endswith(".py") and f[:-3] not in TASK_CONFIGS)
        raise UserError(f"unknown family {family!r} for configs/mqar.py; valid: {', '.join(families)}")
    spec = importlib.util.spec_from_file_location(f"nlearn_config_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config("tiny")


def get_config(family: str = "deltanet"):
    config = family_base(family)
    with config.unlocked():
        config.data.source = "mqar"
        config.data.vocab_size = TASK["vocab_size"]
        config.data.mqar.num_pairs = TASK["num_pairs"]
        config.data.mqar.eval_examples = TASK["eval_examples"]
        config.data.mqar.random_filler = TASK["random_filler"]
        config.data.mqar.curriculum = CURRICULUM
        config.data.eval_tokens = 0  # score every eval example
        config.model.update(MODEL)
        for key, value in FAMILY_OVERRIDES.get(family, {}).items():
            _set(config.model, key, value)
        config.train.update(seq_len=TASK["seq_len"], log_every=50, eval_every=0, **BUDGET)
        for key, value in FAMILY_TRAINING.get(family, {}).items():
            _set(config, key, value)
        config.checkpoint.every_steps = 250
        config.logging.plot = False
    return config
