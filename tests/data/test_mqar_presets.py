"""benchmarks/configs/mqar.py presets (one task and budget for every family) and the `make mqar` table."""

import importlib.util
import os

import pytest

from nlearn import config as config_lib
from nlearn.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def presets():
    return load("benchmarks/configs/mqar.py", "mqar_presets_under_test")


def families():
    return sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def lookup(config, key: str):
    for part in key.split("."):
        config = config[part]
    return config


def test_every_family_gets_the_common_task_and_budget(presets):
    common = {"train.seq_len": presets.TASK["seq_len"], "data.mqar.num_pairs": presets.TASK["num_pairs"],
              "data.vocab_size": presets.TASK["vocab_size"], "model.d_model": presets.MODEL["d_model"],
              "model.num_heads": presets.MODEL["num_heads"], "model.mlp_dim": presets.MODEL["mlp_dim"],
              "train.batch_size": presets.BUDGET["batch_size"], "train.steps": presets.BUDGET["steps"],
              "train.lr": presets.BUDGET["lr"], "train.schedule": presets.BUDGET["schedule"],
              "data.mqar.curriculum": presets.CURRICULUM}
    for family in families():
        c = presets.get_config(family)
        config_lib.validate(c)
        assert c.model.family == family and c.data.source == "mqar"
        assert c.train.seq_len >= 256 and c.data.mqar.num_pairs >= 16
        assert c.model.num_layers == 2 and c.model.d_model <= 128
        assert c.model.vocab_size == c.data.vocab_size == presets.TASK["vocab_size"]
        assert c.data.eval_tokens == 0  # every eval example is scored
        # A family departs from the common budget only where FAMILY_TRAINING says so.
        own = presets.FAMILY_TRAINING.get(family, {})
        for key, value in common.items():
            assert lookup(c, key) == own.get(key, value), (family, key)
    for family, own in presets.FAMILY_TRAINING.items():
        c = presets.get_config(family)
        assert all(lookup(c, key) == value for key, value in own.items())
        assert not set(own) & {"train.seq_len", "data.mqar.num_pairs", "data.vocab_size"}  # the task stays
    assert presets.TIME_LIMIT_S <= 600
    for family, seconds in presets.FAMILY_TIME_LIMIT_S.items():  # its run ends decayed within its own cap
        assert 0 < presets.get_config(family).train.time_budget_s < seconds


def test_override_typos_are_refused(presets):
    with pytest.raises(KeyError, match="no_such_key"):
        presets._set(presets.get_config("deltanet"), "train.no_such_key", 1)


def test_unknown_family_names_the_valid_ones(presets):
    with pytest.raises(UserError, match="valid: .*deltanet"):
        presets.get_config("no_such_family")
    with pytest.raises(UserError):
        presets.get_config("mqar")


def test_table_and_note():
    script = load("benchmarks/mqar.py", "mqar_script_under_test")
    rows = [{"family": "deltanet", "accuracy": 0.995, "params_m": 0.53, "train_seconds": 300.0,
             "step": 1000, "stopped_at_limit": False},
            {"family": "titans_mac", "accuracy": 0.5, "params_m": 0.86, "train_seconds": 600.0,
             "step": 120, "stopped_at_limit": True},
            {"family": "ttt_mlp", "error": "boom"},
            {"family": "titans_mag", "accuracy": 0.9, "params_m": 0.5, "train_seconds": 540.0,
             "step": 700, "stopped_at_limit": False, "steps_total": 700},  # its own step budget
            {"family": "titans_mal", "accuracy": 0.9, "params_m": 0.5, "train_seconds": 560.0, "step": 650,
             "stopped_at_limit": False, "steps_total": 650, "steps_configured": 790}]  # time_budget_s
    lines = script.table(rows, 1000).splitlines()
    assert lines[2] == "| deltanet | 99.5% |  | 0.53M | 5.0 min | 1000 of 1000 |"  # one run: no seeds column
    assert lines[3] == "| titans_mac | 50.0% |  | 0.86M | 10.0 min | 120 of 1000 (time limit) |"
    assert "failed: boom" in lines[4]
    assert lines[5].endswith("| 700 of 700 |")
    assert lines[6].endswith("| 650 of 650 (time budget; preset 790) |")
    text = script.note(script.mqar_presets(), ["deltanet"], 600, "1.0")
    assert "T=256" in text and "16 pairs" in text and "10 minutes" in text
    assert "Per-family training" not in text
    assert text.endswith(" Load average 1.0 at the end.")
    presets = script.mqar_presets()
    text = script.note(presets, ["deltanet", *presets.FAMILY_TRAINING], 600, "1.0")
    for family, own in presets.FAMILY_TRAINING.items():
        assert f"{family}: " + ", ".join(f"{k}={v}" for k, v in own.items()) in text
    assert script.time_limit(presets, "deltanet") == presets.TIME_LIMIT_S
    assert script.time_limit(presets, "self_ref_titans") == presets.FAMILY_TIME_LIMIT_S["self_ref_titans"] > 600
    assert script.time_limit(presets, "self_ref_titans", 60.0) == 60.0  # --time-limit wins
    # a merged row says when its runs trained under another limit than the preset's
    assert script.run_limits(presets, "deltanet", [{"time_limit_s": 600.0}, {}]) == ""
    assert script.run_limits(presets, "deltanet", [{"time_limit_s": 1800.0}, {"time_limit_s": 600.0}]) == (
        " Its runs' wall-time limit (`--time-limit`): 30 minutes.")
    limits = "; ".join(f"{f} {s / 60:.0f} minutes" for f, s in presets.FAMILY_TIME_LIMIT_S.items())
    assert f"wall-time limits: {limits}." in text
    fp = script.preset_fingerprint(presets, "deltanet", [])
    assert fp == script.preset_fingerprint(presets, "deltanet", [])  # --reuse keeps this row
    assert fp != script.preset_fingerprint(presets, "titans_lmm", [])
    assert fp != script.preset_fingerprint(presets, "deltanet", ["--config.train.steps=10"])
    # A cosine run ignores decay_fraction, and hashes as before the schedule keys existed.
    config = presets.get_config("deltanet")
    fixed = type("Presets", (), {"get_config": staticmethod(lambda family: config)})
    assert script.preset_fingerprint(fixed, "deltanet", []) == fp
    config.train.decay_fraction = 0.7
    assert script.preset_fingerprint(fixed, "deltanet", []) == fp
    config.train.schedule = "wsd"
    assert script.preset_fingerprint(fixed, "deltanet", []) != fp
    assert script.schedule({"min_lr_ratio": 0.1}) == ", cosine to 0.1x after warmup"
    assert script.schedule({"min_lr_ratio": 0.1, "schedule": "wsd", "decay_fraction": 0.5}) == (
        ", constant after warmup, then linear to 0.1x over the last 50% of the steps")
    assert script.curriculum_note("", 16, 256) == ""
    assert script.curriculum_note("64x4:300,128x8:50", 16, 256) == (
        " Curriculum: the first 300 steps of 64 windows of 64 tokens with 4 pairs, then 50 steps of "
        "32 windows of 128 tokens with 8 pairs (the same tokens per step); evaluation is on the task only.")
    assert script.last_json('log\n{"step": 3, "mqar_accuracy": 0.5}\n') == {"step": 3, "mqar_accuracy": 0.5}


def test_niah_presets_give_self_referential_memories_the_mqar_settings(presets):
    niah = load("benchmarks/configs/niah.py", "niah_presets_under_test")
    recall = presets.FAMILY_OVERRIDES["self_ref_titans"]
    for family in niah.SELF_REFERENTIAL_FAMILIES:
        c = niah.get_config(family)
        config_lib.validate(c)
        assert c.data.source == "niah" and c.train.seq_len <= 512
        assert all(lookup(c.model, key) == value for key, value in recall.items()), family
    assert niah.get_config("hope").model.hope.mixer == "self_referential"  # Hope's own mixer, not attention
