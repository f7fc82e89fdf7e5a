"""`nlearn-eval --task=...`: the JSON line, eval/<task>.json and its samples, one-line failures."""

import json

from eval_helpers import make_run, small_config
from run_helpers import run_cli


def _text_run(tmp_path, cache_dir, text_corpus):
    config = small_config("transformer", vocab=300)
    with config.unlocked():
        config.data.update({"source": "text", "path": text_corpus, "cache_dir": cache_dir, "eval_tokens": 512})
        config.train.update(seq_len=32, batch_size=4)
    return make_run(config, str(tmp_path / "run"))


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
