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


def test_train_refuses_an_unknown_key(tmp_path, cache_dir, text_corpus):
    proc = run_cli("train", "--config=configs/transformer.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), "--config.train.bogus=1")
    assert_one_line_failure(proc, "bogus")


def test_train_refuses_an_invalid_value_in_one_line(tmp_path, cache_dir, text_corpus):
    proc = run_cli("train", "--config=configs/transformer.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), "--config.train.seq_len=0")
    assert_one_line_failure(proc, "train.seq_len")


# The same check as the CLI's (nlearn.config.validate, which the trainer runs first), in this process: a
# subprocess per value costs ~8 s of imports; the two above show how the CLI prints the refusal.
@pytest.mark.parametrize("family,key,value,needles", [
    ("transformer", "model.family", "rnn", ("model.family", "rnn")),
    ("transformer", "data.source", "web", ("data.source", "web")),
    ("titans_lmm", "model.memory.optimizer", "adamq", ("model.memory.optimizer", "adamq", "momentum", "sgd")),
])
def test_validate_names_the_bad_value_and_the_choices(family, key, value, needles):
    from nlearn.config import validate
    from nlearn.errors import UserError
    from run_helpers import load_family_config

    config = load_family_config(family)
    *path, name = key.split(".")
    node = config
    for part in path:
        node = node[part]
    with node.unlocked():
        node[name] = value
    with pytest.raises(UserError) as refused:
        validate(config)
    message = str(refused.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


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
