"""`nlearn-eval --task=...`: the JSON line, eval/<task>.json and its samples, one-line failures."""

import json

import pytest

from eval_helpers import make_run, small_config
from run_helpers import run_cli


def _text_run(tmp_path, cache_dir, text_corpus):
    config = small_config("transformer", vocab=300)
    with config.unlocked():
        config.data.update({"source": "text", "path": text_corpus, "cache_dir": cache_dir, "eval_tokens": 512})
        config.train.update(seq_len=32, batch_size=4)
    return make_run(config, str(tmp_path / "run"))


@pytest.mark.slow  # tests/test_train.py scores the default task through the CLI too
def test_default_task_is_perplexity_and_writes_its_record(tmp_path, cache_dir, text_corpus):
    workdir = _text_run(tmp_path, cache_dir, text_corpus)
    proc = run_cli("eval", f"--workdir={workdir}")
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["task"] == "perplexity" and line["step"] == 0
    assert set(line) >= {"loss", "perplexity", "accuracy", "tokens"} and line["tokens"] == 512
    record = json.load(open(f"{workdir}/eval/perplexity.json"))
    assert record["loss"] == line["loss"] and record["config"]["train"]["seq_len"] == 32
    assert set(record) >= {"commit", "parameters"} and record["parameters"]["chunk_size"] == 32
    assert open(f"{workdir}/eval/perplexity.samples.jsonl").read() == ""


def test_unknown_task_fails_in_one_line_naming_the_choices(tmp_path):
    proc = run_cli("eval", f"--workdir={tmp_path}", "--task=needles")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "needles" in errors[0] and "niah" in errors[0], proc.stderr


@pytest.mark.slow
def test_niah_through_the_cli(tmp_path, haystack_config):
    """A tiny untrained checkpoint of a niah-trained config: the sweep's JSON line and its records."""
    workdir = make_run(haystack_config(source="niah", **{"niah.min_len": 384}), str(tmp_path / "niah"))
    proc = run_cli("eval", f"--workdir={workdir}", "--task=niah", "--lengths=512,1024", "--samples=2",
                   "--option=depths=2", "--chunk_size=200")
    assert proc.returncode == 0, proc.stderr
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["task"] == "niah" and line["step"] == 0 and 0.0 <= line["accuracy"] <= 1.0
    assert list(line["by_length"]) == ["512", "1024"] and list(line["by_depth"]) == ["0", "100"]
    assert list(line["by_variant"]) == ["single_1"] and set(line["by_length_depth"]["1024"]) == {"0", "100"}
    assert list(line["by_length_char"]) == ["512", "1024"] and all(len(v) == 7 for v in line["by_length_char"].values())
    assert "niah single_1 at 1024 tokens: 2 prompts, accuracy" in proc.stderr  # progress, one line per length
    records = [json.loads(r) for r in open(f"{workdir}/eval/niah.samples.jsonl")]
    assert len(records) == 4 and all(len(r["targets"][0]) == 7 and "output" in r for r in records)
    assert all(r["prompt_tokens"] <= r["length"] for r in records)
    record = json.load(open(f"{workdir}/eval/niah.json"))
    assert record["parameters"]["lengths"] == [512, 1024] and record["parameters"]["chunk_size"] == 200
