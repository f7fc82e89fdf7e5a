"""Entry points refuse bad input with one line naming the culprit, exit non-zero, no traceback."""

import pytest

from run_helpers import run_cli, tiny_overrides


def assert_one_line_failure(proc, *needles):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("override,needle", [
    ("--config.train.bogus=1", "bogus"),
    ("--config.train.seq_len=0", "train.seq_len"),
    ("--config.model.family=rnn", "model.family"),
    ("--config.data.source=web", "data.source"),
])
def test_train_refuses_bad_overrides(tmp_path, cache_dir, text_corpus, override, needle):
    proc = run_cli("train", "--config=configs/transformer.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), override)
    assert_one_line_failure(proc, needle)


def test_train_refuses_missing_config_file(tmp_path):
    proc = run_cli("train", "--config=configs/nope.py:tiny", f"--workdir={tmp_path}")
    assert_one_line_failure(proc, "nope.py")


def test_train_refuses_unknown_preset(tmp_path):
    proc = run_cli("train", "--config=configs/transformer.py:huge", f"--workdir={tmp_path}")
    assert_one_line_failure(proc, "huge")


def test_text_glob_matching_nothing(tmp_path, cache_dir, text_corpus):
    glob = str(tmp_path / "missing" / "*.txt")
    proc = run_cli("train", "--config=configs/transformer.py:tiny", f"--workdir={tmp_path / 'run'}",
                   *tiny_overrides(cache_dir, text_corpus, **{"data.path": glob}))
    assert_one_line_failure(proc, glob)


def test_eval_without_checkpoint(tmp_path):
    proc = run_cli("eval", "--config=configs/transformer.py:tiny", f"--workdir={tmp_path}")
    assert_one_line_failure(proc, "checkpoint")


def test_generate_on_non_run_directory(tmp_path):
    proc = run_cli("generate", f"--workdir={tmp_path}", "--prompt=hello")
    assert_one_line_failure(proc, "config.json")


def test_unknown_inner_optimizer_is_refused_with_valid_choices(tmp_path, cache_dir, text_corpus):
    proc = run_cli("train", "--config=configs/titans_lmm.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), "--config.model.memory.optimizer=adamq")
    assert_one_line_failure(proc, "model.memory.optimizer", "adamq", "momentum", "sgd")


def test_an_override_of_a_key_named_like_a_configdict_method_reaches_the_config(tmp_path, cache_dir, text_corpus):
    """`model.cms.update` shares its name with `ConfigDict.update`: set through the CLI all the same."""
    from nlearn.cli.common import _apply_method_key_overrides, _split_method_key_overrides
    from run_helpers import load_family_config

    argv, held = _split_method_key_overrides(["p", "--config.model.cms.update=none", "--config.train.steps=3"])
    assert argv == ["p", "--config.train.steps=3"] and held == [("model.cms.update", "none")]
    config = load_family_config("hope")
    _apply_method_key_overrides(config, held)
    assert config.model.cms["update"] == "none"
    proc = run_cli("train", "--config=configs/hope.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), "--config.model.cms.update=sgd")
    assert_one_line_failure(proc, "cms.update", "sgd")
