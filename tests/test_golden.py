"""Golden one-step values for every registered family, so a changed default, init or wiring fails
with the family's name.

Each family's `tiny` preset (`configs/<family>.py`; one layer instead of its four, every other
model key as the preset has it, so a test compiles in seconds) at train.seed 0 takes one real train
step (`nlearn.train.step.make_train_step`, AdamW as configured) on a fixed batch of 2 x 128 tokens
(two MAC segments, two chunks of the chunked ops, eight memory mini-batches). The step's loss and
gradient norm and three statistics of the first logits (mean, RMS, a fixed random projection)
must equal `golden_values.json` within `RTOL` = 1e-5: they are float32 results of one CPU program,
identical when rerun; compiling it with other XLA options moved them by ~2e-7 relative (reordered
float32 sums), so 1e-5 is well above that noise, and below what small changes of the model move
(titans_mac's memory written from x + y instead of x: grad norm 1.7e-4, projection 2.3e-4 · RMS;
titans_lmm's decay_init 0.001 instead of sigmoid(-4): all five, the projection by 7e-2 · RMS).
The mean's and the projection's tolerance is RTOL times the logits' RMS, as they may sit near 0.
The loss alone is nearly log(vocab) at initialisation; the logits' statistics and the gradient
norm carry most of the sensitivity.

Regenerate (deliberately: after a change of a default, init or wiring that is meant; review the
diff of the JSON):
    NLEARN_UPDATE_GOLDEN=1 pytest tests/test_golden.py
"""

from __future__ import annotations

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nlearn import models
from nlearn.train.state import make_setup
from nlearn.train.step import logits_of, make_train_step

GOLDEN_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_values.json")
UPDATE = os.environ.get("NLEARN_UPDATE_GOLDEN") == "1"
BATCH, SEQ_LEN, SEED, NUM_LAYERS = 2, 128, 0, 1
RTOL = 1e-5
# Compile time is most of this file's time: one jitted program per family, with LLVM's optimisations
# off (about a third less compile time on CPU; the values moved by ~2e-7 relative, inside RTOL).
COMPILER_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
KEYS = ("loss", "grad_norm", "logits_mean", "logits_rms", "logits_proj")
FAMILIES = sorted(models.FAMILIES)


def golden_config(family: str):
    """The family's `tiny` preset with the golden batch shape, seed and depth (every other model key
    as the preset has it)."""
    config = importlib.import_module(family).get_config("tiny")
    with config.unlocked():
        config.model.num_layers = NUM_LAYERS
        config.train.update(batch_size=BATCH, seq_len=SEQ_LEN, seed=SEED, grad_accum=1)
    return config


def _batch(vocab: int) -> dict:
    tokens = np.random.default_rng(SEED).integers(0, vocab, (BATCH, SEQ_LEN + 1), dtype=np.int32)
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def one_step_values(family: str) -> dict:
    """The golden quantities of `family`: one jitted program (init, first logits, one train step)."""
    config = golden_config(family)
    setup = make_setup(config)
    step = make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=setup.dtype)
    batch = _batch(config.model.vocab_size)
    # A fixed ±1 pattern over the logits: a change anywhere in them moves the projection.
    signs = np.where(np.random.default_rng(1).random((BATCH, SEQ_LEN, config.model.vocab_size)) < 0.5, -1.0, 1.0)

    def run(batch, signs_BTV):
        state = setup.init_state()
        logits = logits_of(setup.graphdef, state["params"], batch["inputs"], setup.dtype)
        _, metrics = step(state, batch)
        return dict(loss=metrics["loss"], grad_norm=metrics["grad_norm"], logits_mean=jnp.mean(logits),
                    logits_rms=jnp.sqrt(jnp.mean(jnp.square(logits))),
                    logits_proj=jnp.sum(logits * signs_BTV) / np.sqrt(logits.size))

    out = jax.jit(run, compiler_options=COMPILER_OPTIONS)(batch, jnp.asarray(signs, jnp.float32))
    return {k: float(v) for k, v in jax.device_get(out).items()}


def _load() -> dict:
    if not os.path.exists(GOLDEN_PATH):
        return {}
    with open(GOLDEN_PATH) as f:
        return json.load(f)["families"]


@pytest.mark.parametrize("family", FAMILIES)  # every family in the default suite
def test_one_step_matches_golden(family):
    values = one_step_values(family)
    if UPDATE:
        golden = {k: v for k, v in _load().items() if k in FAMILIES}  # families since removed go
        golden[family] = values
        with open(GOLDEN_PATH, "w") as f:
            json.dump({"regenerate": "NLEARN_UPDATE_GOLDEN=1 pytest -m 'slow or not slow' tests/test_golden.py",
                       "setting": {"preset": "tiny", "num_layers": NUM_LAYERS, "batch": BATCH, "seq_len": SEQ_LEN,
                                   "seed": SEED}, "jax": jax.__version__,
                       "backend": jax.default_backend(), "families": dict(sorted(golden.items()))}, f, indent=1)
            f.write("\n")
        return
    golden = _load()
    assert family in golden, (f"family {family!r} has no golden values in {os.path.basename(GOLDEN_PATH)}; "
                              "add them with NLEARN_UPDATE_GOLDEN=1 pytest -m 'slow or not slow' tests/test_golden.py")
    expected = golden[family]
    # The mean and the projection may sit near 0: their tolerance scales with the logits' RMS.
    scale = {k: abs(expected["logits_rms"]) for k in ("logits_mean", "logits_proj")}
    wrong = [f"{k}: {values[k]!r} != golden {expected[k]!r}" for k in KEYS
             if abs(values[k] - expected[k]) > RTOL * max(abs(expected[k]), scale.get(k, 0.0))]
    assert not wrong, f"{family}: one-step values changed ({'; '.join(wrong)})"
