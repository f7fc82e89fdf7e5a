"""The experiment scripts (ablate, compare_lm), the `make train` default and the CLI environment."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from run_helpers import load_family_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_script(name: str):
    path = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"nlearn_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_default(name: str) -> str:
    text = open(os.path.join(ROOT, "Makefile")).read()
    return re.search(rf"^{name} \?= (\S+)$", text, re.M).group(1)


@pytest.mark.parametrize("script", ["ablate", "compare_lm"])
def test_throughput_weights_intervals_by_tokens(script):
    # Steps 2..5 at 100 tok/s and 6..9 at 400 tok/s (10 tokens a step): 80 tokens in 0.5 s.
    records = [{"step": 5, "tokens_per_sec": 100.0, "loss": 1.0}, {"step": 9, "tokens_per_sec": 400.0},
               {"step": 9, "eval_loss": 1.0}]
    assert load_script(script).throughput(records, 10) == pytest.approx(80 / 0.5)


def test_ablate_table_has_a_row_per_variant_and_refusals():
    ablate = load_script("ablate")
    rows = [{"variant": "default", "train_loss": 6.5, "eval_loss": 6.6, "tokens_per_sec": 1234.0, "minutes": 1.5},
            {"variant": "optimizer=adamq", "error": "error: invalid config value model.memory.optimizer='adamq'"},
            {"variant": "depth=3", "error": "error: training loss became nan at step 20"},
            {"variant": "minibatch=4", "not_run": True}]
    lines = ablate.table(rows).splitlines()
    assert lines[2] == "| default | 6.500 | 6.600 | 1,234 | 1.5 min |"
    assert lines[3].startswith("| optimizer=adamq | refused: `error: invalid config value")
    assert lines[4].startswith("| depth=3 | failed: `error: training loss became nan")
    assert lines[5] == "| minibatch=4 | not run | | | |"
    assert "optimizer=adamq" in ablate.VARIANTS["titans_lmm"]


def test_ablate_variants_reach_any_model_section_and_keep_other_families(tmp_path, monkeypatch):
    ablate = load_script("ablate")
    assert ablate.overrides_of("optimizer=sgd") == ["--config.model.memory.optimizer=sgd"]
    assert ablate.overrides_of("cms.periods=(16,64) hope.mixer=attention") == [
        "--config.model.cms.periods=(16,64)", "--config.model.hope.mixer=attention"]
    assert ablate.split_variants(",cms.periods=(16,64),memory.dgd=False") == ["", "cms.periods=(16,64)",
                                                                              "memory.dgd=False"]
    monkeypatch.setattr(ablate, "machine", lambda: "a machine")
    for family, rows in (("titans_lmm", "| a |"), ("hope", "| b |"), ("titans_lmm", "| c |")):
        path = ablate.write_section("x.md", f"Ablations ({family})", "cmd", rows, directory=str(tmp_path))
    text = open(path).read()
    assert text.count("# Ablations (titans_lmm)") == 1 and "| c |" in text and "| a |" not in text
    assert text.index("# Ablations (hope)") < text.index("# Ablations (titans_lmm)") and "| b |" in text


def test_ablate_records_a_refused_variant_as_one_line(tmp_path):
    row = load_script("ablate").run("titans_lmm", "optimizer=adamq", str(tmp_path / "run"), 1, [])
    assert row["variant"] == "optimizer=adamq"
    assert row["error"].startswith("error: invalid config value model.memory.optimizer='adamq'"), row


def test_make_train_default_is_a_titans_model_with_the_transformer_parameter_count():
    from nlearn.models import count_params

    model = make_default("MODEL")
    assert model.startswith("titans_")
    titans, transformer = load_family_config(model), load_family_config("transformer")
    for key in ("batch_size", "seq_len"):  # equal tokens per step for the comparison
        assert titans.train[key] == transformer.train[key]
    ratio = count_params(titans) / count_params(transformer)
    assert abs(ratio - 1) < 0.03, ratio


def test_cli_runs_lapack_on_one_openblas_thread_and_importing_nlearn_sets_nothing():
    code = ("import os, warnings; from flax import nnx; eager = nnx.using_eager_sharding(); "
            "filters = list(warnings.filters); "
            "import nlearn.cli.common, nlearn.layers, nlearn.models, nlearn.data, nlearn.train.trainer; "
            "assert nnx.using_eager_sharding() == eager and warnings.filters == filters; "
            "print(os.environ.get('OPENBLAS_NUM_THREADS')); "
            "nlearn.cli.common.run(lambda argv: print(os.environ['OPENBLAS_NUM_THREADS']))")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["None", "1"], out.stderr  # set by the entry point, not by an import
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(env, OPENBLAS_NUM_THREADS="2"))
    assert out.stdout.split() == ["2", "2"], out.stderr  # a user's own setting wins


def test_cli_on_a_machine_without_a_tpu_starts_no_tpu_runtime():
    """With libtpu installed (nlearn[tpu], as `make setup` does) and no TPU attached, an entry point computes on
    the CPU without the TPU runtime's errors about missing hosts; elsewhere it leaves jax's choice alone."""
    from nlearn.cli.common import tpu_runtime_without_a_tpu

    code = ("import os, nlearn.cli.common as c; c.run(lambda argv: print(os.environ.get('JAX_PLATFORMS'), "
            "__import__('jax').devices()[0].platform))")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    if tpu_runtime_without_a_tpu():
        assert out.stdout.split() == ["cpu", "cpu"] and "TPU" not in out.stderr, out.stderr[-2000:]
    else:
        assert out.stdout.split()[0] == "None", out.stdout + out.stderr[-2000:]


def test_cli_drops_only_orbax_read_only_warnings():
    import logging

    from nlearn.cli.common import _drop_orbax_read_only

    def record(path, msg):
        return logging.LogRecord("absl", logging.WARNING, path, 1, msg, (), None)

    orbax = "/x/site-packages/orbax/checkpoint/checkpoint_manager.py"
    assert not _drop_orbax_read_only(record(orbax, "Options.read_only=True, setting max_to_keep=None."))
    assert not _drop_orbax_read_only(record(orbax, "Given directory is read only=/tmp/run/checkpoints"))
    assert _drop_orbax_read_only(record(orbax, "checkpoint directory is missing"))
    assert _drop_orbax_read_only(record("/x/nlearn/train/checkpoint.py", "step 3 is read only"))


def test_results_files_say_which_command_made_them_where_and_when(tmp_path):
    results = load_script("results_md")
    path = results.write_results("x.md", "Title", "python scripts/x.py --a=1", "| a |\n|---|\n| 1 |\n", "A note.",
                                 directory=str(tmp_path))
    lines = open(path).read().splitlines()
    assert lines[0] == "# Title" and lines[4] == "A note." and lines[6:] == ["| a |", "|---|", "| 1 |"]
    assert re.fullmatch(r"Made by `python scripts/x\.py --a=1` on .+, \d+ cores?, f32 matmul \d+ GFLOP/s, "
                        r"20\d\d-\d\d-\d\d\.", lines[2]), lines[2]
    for script, name in [("mqar", "mqar.md"), ("ablate", "ablations.md"),
                         ("bench_ops", "bench_ops.md")]:  # each script rewrites its own file, never README.md
        text = open(os.path.join(ROOT, "benchmarks", f"{script}.py")).read()
        writer = "write_section" if script == "ablate" else "write_results"  # ablate: a section per family
        assert f'{writer}("{name}"' in text and "README.md" not in text
    text = open(os.path.join(ROOT, "benchmarks", "compare_lm.py")).read()  # two files: five rows, the ladder
    assert '"lm_comparison.md"' in text and '"ladder.md"' in text and "write_results(name" in text
    assert "README.md" not in text


def test_compare_lm_rows_take_overrides_and_split_outside_brackets():
    compare = load_script("compare_lm")
    rows = compare.split_rows("transformer, hope:model.cms.periods=(16,64):model.cms.lr='(1e-3,1e-3)',hope")
    assert rows == ["transformer", "hope:model.cms.periods=(16,64):model.cms.lr='(1e-3,1e-3)'", "hope"]
    assert compare.parse_row(rows[1]) == ("hope", ["--config.model.cms.periods=(16,64)",
                                                   "--config.model.cms.lr='(1e-3,1e-3)'"])
    with pytest.raises(ValueError, match="'model.hope.mixer' is not key=value"):
        compare.parse_row("hope:model.hope.mixer")
    assert "transformer" in compare.all_families() and "hope" in compare.all_families()


def test_compare_lm_table_has_seed_mean_spread_and_flags_unequal_parameters():
    compare = load_script("compare_lm")
    same = {"data": {"source": "builtin"}, "seed": 0, "steps": 5, "batch_size": 2, "seq_len": 8}

    def run(row, seed, ppl, **extra):
        return {"row": row, "seed": seed, "params_m": 1.0, "tokens": 80, "perplexity": ppl, "eval_tokens": 64,
                "unigram": 900.0, "tokens_per_sec": 1000.0, "minutes": 0.5,
                "same_batches": dict(same, seed=seed), **extra}

    runs = [run("transformer", 0, 500.0), run("transformer", 1, 520.0), run("a:model.x=1", 0, 400.0),
            run("a:model.x=1", 1, 510.0), {"row": "b", "seed": 0, "error": "error: training loss became nan"}]
    entries = compare.summarise(runs, ["transformer", "a:model.x=1", "b", "c"])
    counts = {"transformer": 1_000_000, "a:model.x=1": 1_060_000, "b": 990_000, "c": 1_000_000}
    lines = compare.table(entries, counts).splitlines()
    assert lines[2] == "| transformer | 1.00M | +0.0% | 0.00M | 510.0 ± 10.0 | 500.0, 520.0 | 1,000 | 0.5 min |"
    assert "| **+6.0%** (over 5%) |" in lines[3] and "| 455.0 ± 55.0 | 400.0, 510.0 |" in lines[3]
    assert lines[4] == "| b | 0.99M | -1.0% | | seed 0 failed: `error: training loss became nan` | | | |"
    assert lines[5] == "| c | 1.00M | +0.0% | | not run | | | |" and lines[6].startswith("| unigram baseline |")
    assert compare.param_warnings(counts) == [
        "warning: a:model.x=1 has 1.06M parameters, +6.0% from transformer's 1.00M "
        "(more than 5%: not an equal-parameter comparison)"]
    assert compare.overlaps(entries) == ["a:model.x=1 ~ transformer"]  # 400-510 overlaps 500-520
    runs[2]["same_batches"] = dict(same, data={"source": "builtin", "niah": {"min_len": 256}})  # another source's
    assert compare.data_mismatches(runs) == []
    runs[2]["same_batches"] = dict(same, seq_len=16)
    assert compare.data_mismatches(runs) == [
        "warning: seed 0: a:model.x=1 did not train or score on the same tokens as transformer"]


def test_compare_lm_rows_from_several_logs_keep_the_latest_run_of_a_row_and_seed(tmp_path):
    compare = load_script("compare_lm")
    old, new = tmp_path / "old.jsonl", tmp_path / "new.log"
    old.write_text('{"row": "a", "seed": 0, "perplexity": 9}\n{"row": "b", "seed": 0, "perplexity": 8}\n')
    new.write_text('noise\n{"row": "b", "seed": 0, "perplexity": 7}\n{"row": "b", "seed": 1, "perplexity": 6}\n')
    runs = compare.read_runs(f"{old},{new}")
    assert [(r["row"], r["seed"], r["perplexity"]) for r in runs] == [("a", 0, 9), ("b", 0, 7), ("b", 1, 6)]


def test_compare_lm_counts_parameters_of_rows_with_overrides_and_refuses_a_bad_row(capsys):
    compare = load_script("compare_lm")
    counts = compare.param_counts(["titans_lmm:model.mlp_dim=384"], [])
    assert list(counts) == ["transformer", "titans_lmm:model.mlp_dim=384"]
    assert counts["titans_lmm:model.mlp_dim=384"] < load_family_count("titans_lmm")
    for row, needle in [("nofamily", "no config file configs/nofamily.py"),
                        ("transformer:model.nope=1", "unknown config key 'model.nope'"),
                        ("transformer:model.dtype=float8", "model.dtype")]:
        with pytest.raises(SystemExit) as exit_:
            compare.param_counts([row], [])
        err = capsys.readouterr().err.strip()
        assert exit_.value.code != 0 and err.startswith(f"error: row {row!r}: ") and needle in err, err
        assert "\n" not in err


def load_family_count(family: str) -> int:
    from nlearn.models import count_params

    return count_params(load_family_config(family))



def test_mqar_merge_replaces_or_appends_a_row_and_stamps_it():
    mqar = load_script("mqar")
    text = "# T\n\nNote.\n\n| family | a |\n|---|---|\n| x | 1 |\n| y | 2 |\n\nAfter.\n"
    head = "| family | a |\n|---|---|\n"
    out = mqar.merge_rows(text, head + "| z | 3 |", "z: one.")
    out = mqar.merge_rows(out, head + "| x | 9 |", "x: two.")
    out = mqar.merge_rows(out, head + "| z | 4 |", "z: three.")
    assert out == ("# T\n\nNote.\n\n| family | a |\n|---|---|\n| x | 9 |\n| y | 2 |\n| z | 4 |\n\n"
                   "Merged row z: three.\nMerged row x: two.\n\nAfter.\n")


def test_mqar_row_is_the_median_over_seeds_with_each_seed_shown():
    mqar = load_script("mqar")
    run = {"params_m": 0.35, "train_seconds": 60.0, "stopped_at_limit": False, "steps_total": 10}
    runs = [{**run, "seed": 0, "accuracy": 0.99, "step": 10}, {**run, "seed": 1, "accuracy": 0.5, "step": 8},
            {**run, "seed": 2, "accuracy": 0.97, "step": 9}]
    row = mqar.seed_row("titans_lmm", runs)
    assert row["accuracy"] == 0.97 and row["step"] == 9  # the median seed's run gives time and steps
    assert mqar.table([row], 10).splitlines()[2] == (
        "| titans_lmm | 97.0% | 99.0 / 50.0 / 97.0% (seeds 0,1,2) | 0.35M | 1.0 min | 9 of 10 |")
    failed = mqar.seed_row("titans_lmm", runs[:2] + [{"seed": 2, "error": "boom"}])
    assert "seed 2: boom" in mqar.table([failed], 10)


def test_step_cost_compiles_a_row_with_its_overrides_and_refuses_an_unknown_key():
    step_cost = load_script("step_cost")
    step, state, data = step_cost.compiled_step("transformer:model.num_layers=1", 2, 16)
    assert int(state["step"]) == 1 and data["inputs"].shape == (2, 16)
    assert len(state["params"]["blocks"]) == 1
    state, _ = step(state, data)
    assert int(state["step"]) == 2
    with pytest.raises(ValueError, match="model.num_layerz"):
        step_cost.compiled_step("transformer:model.num_layerz=1", 2, 16)
