"""`benchmarks/make_results.py` (`make results`) on eval records fabricated here, as `nlearn-eval` writes them."""

from __future__ import annotations

import json
import os

import pytest

from test_scripts import load_script

CI = "[0%, 100%]"  # the 95% interval niah_record gives every length


def niah_record(family: str, seq_len: int, acc_by_length: dict, intervals: bool = True, task: str = "niah",
                variant: str = "single_1") -> dict:
    by_ld = {str(n): {"0": a, "50": a / 2, "100": a} for n, a in acc_by_length.items()}
    summary = {"accuracy": sum(acc_by_length.values()) / len(acc_by_length),
               "by_length": {str(n): a for n, a in acc_by_length.items()}, "by_length_depth": by_ld}
    if intervals:  # [0, 1]: keeps the expected cells short
        summary["ci95_by_length"] = {str(n): [0.0, 1.0] for n in acc_by_length}
    return {"task": task, "step": 40, **summary, "by_variant": {variant: summary},
            "scoring": "RULER string_match_all", "config": {"model": {"family": family},
                                                             "train": {"seq_len": seq_len, "batch_size": 4},
                                                             "data": {"cache_dir": "/elsewhere/nlearn-cache"}}}


def per_position_record(family: str, inner: bool) -> dict:
    by_position = {"0": {"end": 1, "loss": 6.0, "loss_ci95": 0.2}, "1": {"end": 8, "loss": 5.0, "loss_ci95": 0.1},
                   "8": {"end": 64, "loss": 4.5, "loss_ci95": 0.1}}
    record = {"task": "per_position", "step": 40, "loss": 4.6, "perplexity": 99.5, "by_position": by_position,
              "within_window_loss": 4.8, "beyond_window_loss": 4.51, "length": 64, "documents": 3,
              "source": "documents", "train_seq_len": 16, "family": family}
    if inner:
        record["inner_loss"] = {"mean_before": 0.75, "mean_after": 0.25, "by_position": {
            k: {"end": v["end"], "before": 0.75, "before_ci95": 0.01, "after": 0.25, "after_ci95": 0.01}
            for k, v in by_position.items()}}
    return record


def write_run(root, name: str, *records) -> None:
    os.makedirs(root / name / "eval")
    for r in records:
        (root / name / "eval" / f"{r['task']}.json").write_text(json.dumps(r))
    (root / name / "eval" / f"{records[0]['task']}.samples.jsonl").write_text("{}\n")  # not a record: skipped


def test_make_results_writes_tables_and_plots(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "results"
    train = {"seq_len": 16, "batch_size": 4}
    write_run(runs, "lmm", niah_record("titans_lmm", 16, {16: 1.0, 64: 0.95, 256: 0.9}),
              per_position_record("titans_lmm", inner=True),
              {"task": "perplexity", "step": 40, "loss": 4.25, "perplexity": 70.1,
               "config": {"model": {"family": "titans_lmm"}, "train": train}})
    write_run(runs, "tf", niah_record("transformer", 16, {16: 1.0, 64: 0.05}),
              per_position_record("transformer", inner=False))
    write_run(runs, "mqar_a", {"task": "mqar", "step": 7, "accuracy": 0.5, "mqar_accuracy": 0.875,
                               "config": {"model": {"family": "deltanet"}, "train": train}})
    write_run(runs, "mqar_b", {"task": "mqar", "step": 7, "accuracy": 0.5, "mqar_accuracy": 0.25,
                               "config": {"model": {"family": "deltanet"}, "train": train}})
    (runs / "empty").mkdir()
    written = load_script("make_results").main([str(runs / "*"), "--out", str(out)])
    assert sorted(os.path.basename(p) for p in written) == ["lm_eval.md", "mqar_eval.md", "niah.md",
                                                            "per_position.md"]
    niah = (out / "niah.md").read_text()
    assert f"| titans_lmm | single_1 | 16 | 40 | 100% {CI} (16) | 95% {CI} (64) | 90% {CI} (256) |  |  | 95% |" in niah
    # no 16x: empty
    assert f"| transformer | single_1 | 16 | 40 | 100% {CI} (16) | 5% {CI} (64) |  |  |  | 52% |" in niah
    assert "| deltanet | not run |" in niah and "| hope | not run |" in niah  # every family has a row
    # what the run changed from today's preset (not where it cached)
    assert (f"nlearn-train --config=benchmarks/configs/niah.py:titans_lmm --workdir={runs / 'lmm'} "
            "--config.train.batch_size=4 --config.train.seq_len=16\n") in niah
    for png in ("niah_titans_lmm.png", "niah_transformer.png", "per_position.png"):
        assert f"({png})" in (out / ("per_position.md" if png == "per_position.png" else "niah.md")).read_text()
        assert (out / png).stat().st_size > 2000
    per_position = (out / "per_position.md").read_text()
    assert "| titans_lmm | 40 |  | 16 | 64 | 3 (documents) | 4.800 | 4.510 | 0.750 / 0.250 |" in per_position
    assert "| transformer | 40 |  | 16 | 64 | 3 (documents) | 4.800 | 4.510 |  |" in per_position
    assert "| titans_lmm | 40 | 2,560 | 4.250 | 70.100 |" in (out / "lm_eval.md").read_text()
    mqar = (out / "mqar_eval.md").read_text()  # two deltanet runs: labelled by their directories
    assert "| deltanet (mqar_a) | 7 | 448 | 88% |" in mqar and "| deltanet (mqar_b) | 7 | 448 | 25% |" in mqar


def test_niah_table_keeps_rows_of_runs_not_rendered_again(tmp_path):
    make_results, out = load_script("make_results"), tmp_path / "results"
    write_run(tmp_path / "a", "lmm", niah_record("titans_lmm", 16, {16: 1.0, 64: 0.5}))
    make_results.main([str(tmp_path / "a" / "*"), "--out", str(out)])
    write_run(tmp_path / "b", "dn", niah_record("deltanet", 16, {16: 0.75}))
    make_results.main([str(tmp_path / "b" / "*"), "--out", str(out)])
    niah = (out / "niah.md").read_text()
    assert f"| titans_lmm † | single_1 | 16 | 40 | 100% {CI} (16) | 50% {CI} (64) |" in niah  # carried over, marked
    assert f"| deltanet | single_1 | 16 | 40 | 75% {CI} (16) |" in niah and "| titans_lmm | not run |" not in niah
    assert f"--workdir={tmp_path / 'a' / 'lmm'} --config.train.batch_size=4" in niah  # its commands kept
    assert "(niah_titans_lmm.png)" in niah and "Rows marked † are kept" in niah
    make_results.main([str(tmp_path / "b" / "*"), "--out", str(out)])  # a third render: still there, once
    assert (out / "niah.md").read_text().count("| titans_lmm † |") == 1
    make_results.main([str(tmp_path / "a" / "*"), "--out", str(out)])  # rendered again: replaced, unmarked
    niah = (out / "niah.md").read_text()
    assert niah.count("| titans_lmm | single_1 |") == 1 and "| titans_lmm † |" not in niah
    assert "| deltanet † | single_1 |" in niah


def test_a_new_run_of_a_family_does_not_take_the_place_of_its_earlier_row(tmp_path):
    make_results, out = load_script("make_results"), tmp_path / "results"
    write_run(tmp_path / "a", "preset", niah_record("titans_mac", 16, {16: 1.0, 64: 0.5}))
    make_results.main([str(tmp_path / "a" / "*"), "--out", str(out)])
    write_run(tmp_path / "b", "mixture", niah_record("titans_mac", 16, {16: 0.25}))
    make_results.main([str(tmp_path / "b" / "*"), "--out", str(out)])
    niah = (out / "niah.md").read_text()
    assert f"| titans_mac † | single_1 | 16 | 40 | 100% {CI} (16) | 50% {CI} (64) |" in niah  # the earlier row, kept
    assert f"| titans_mac (mixture) | single_1 | 16 | 40 | 25% {CI} (16) |" in niah  # the new one, by its directory
    assert "(niah_titans_mac.png)" in niah and "(niah_titans_mac_mixture.png)" in niah
    assert (out / "niah_titans_mac.png").exists() and (out / "niah_titans_mac_mixture.png").exists()
    write_run(tmp_path / "c", "other", niah_record("deltanet", 16, {16: 0.75}))
    make_results.main([str(tmp_path / "c" / "*"), "--out", str(out)])  # both titans_mac rows are carried now
    niah = (out / "niah.md").read_text()
    assert f"| titans_mac † | single_1 | 16 | 40 | 100% {CI} (16) | 50% {CI} (64) |" in niah
    assert f"| titans_mac (mixture) † | single_1 | 16 | 40 | 25% {CI} (16) |" in niah
    assert niah.count("| titans_mac † |") == 1 and "(niah_titans_mac_mixture.png)" in niah


def test_rows_without_intervals_are_not_carried_and_babilong_has_its_table(tmp_path):
    """Rows scored before RULER-comparable scoring (no 95% intervals) leave niah.md on the next render;
    babilong records get babilong.md, one row per qa task."""
    make_results, out = load_script("make_results"), tmp_path / "results"
    write_run(tmp_path / "a", "old", niah_record("titans_lmm", 16, {16: 1.0}, intervals=False))
    make_results.main([str(tmp_path / "a" / "*"), "--out", str(out)])
    assert "| titans_lmm | single_1 | 16 | 40 | 100% (16) |" in (out / "niah.md").read_text()
    write_run(tmp_path / "b", "mix", niah_record("titans_mac", 16, {16: 0.75}),
              niah_record("titans_mac", 16, {16: 0.5, 64: 0.25}, task="babilong", variant="qa2"))
    written = make_results.main([str(tmp_path / "b" / "*"), "--out", str(out)])
    niah = (out / "niah.md").read_text()
    assert "titans_lmm" not in niah.split("| not run |")[0] and "| titans_lmm | not run |" in niah
    assert "babilong.md" in [os.path.basename(p) for p in written]
    babilong = (out / "babilong.md").read_text()
    assert f"| titans_mac | qa2 | 16 | 40 | 50% {CI} (16) | 25% {CI} (64) |" in babilong
    assert f"--workdir={tmp_path / 'b' / 'mix'} --task=babilong" in babilong


def test_make_results_says_when_nothing_is_there(tmp_path):
    with pytest.raises(SystemExit, match="no eval/\\*.json"):
        load_script("make_results").main([str(tmp_path / "*"), "--out", str(tmp_path / "out")])
    (tmp_path / "bad" / "eval").mkdir(parents=True)
    (tmp_path / "bad" / "eval" / "niah.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad/eval/niah.json"):
        load_script("make_results").main([str(tmp_path / "*"), "--out", str(tmp_path / "out")])
