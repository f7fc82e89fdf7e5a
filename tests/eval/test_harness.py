"""The lm-eval adapter (`nlearn.eval.harness`): local tasks through lm-eval's evaluator and its command line,
and the adapter's numbers against nlearn's own (streaming identities, windows, batching, perplexity).

One untrained deltanet run (d_model 32, 2 layers) on a small text corpus serves every test; chunks of 16
tokens make every stream and long request cross several chunks.
"""

import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from eval_helpers import make_run, small_config  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from nlearn.data.tokenizer import NEWLINE_ID  # noqa: E402
from nlearn.errors import UserError  # noqa: E402

LINES = ["It is a truth universally acknowledged, that a single man in possession of a good fortune,",
         "must be in want of a wife. However little known the feelings or views of such a man may be",
         "on his first entering a neighbourhood, this truth is so well fixed in the minds of families,"]
QUESTIONS = [("A single man in possession of a good fortune must be in want of a", ["wife", "horse", "truth"], 0),
             ("It is a truth universally", ["acknowledged", "forgotten", "green"], 0),
             ("This truth is so well fixed in the minds of", ["families", "fortune"], 0)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, cache_dir):
    """An untrained deltanet run on 8 short documents, each opening with a line break (so a held-out
    document reads as one that follows a line break: the perplexity comparison's first token)."""
    root = tmp_path_factory.mktemp("harness")
    for i in range(8):
        (root / "corpus").mkdir(exist_ok=True)
        lines = LINES[i % 3:] + LINES[: i % 3]
        (root / "corpus" / f"doc{i}.txt").write_text("\n" + "\n".join(lines) + "\n")
    config = small_config("deltanet", vocab=300)
    with config.unlocked():
        config.data.update(source="text", path=str(root / "corpus" / "*.txt"), cache_dir=cache_dir, eval_tokens=0,
                           val_fraction=0.01)
        config.train.update(seq_len=384, batch_size=2)
    return make_run(config, str(root / "run"))


@pytest.fixture(scope="module")
def lm(run_dir):
    from nlearn.eval.harness import NlearnLM

    return NlearnLM(pretrained=run_dir, chunk_size=16, batch_size=4)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    """A multiple-choice task and a perplexity task as lm-eval YAML over local JSONL files."""
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    with open(root / "mc.jsonl", "w") as f:
        for question, choices, answer in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    with open(root / "ppl.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"text": "\n".join(LINES[i:])}) + "\n")
    common = "dataset_path: json\ntest_split: test\n"
    (root / "nlearn_mc.yaml").write_text(
        f"task: nlearn_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    (root / "nlearn_ppl.yaml").write_text(
        f"task: nlearn_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: byte_perplexity\n")
    return str(root)


def request(kind, *args):
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def expected_metrics(lm):
    """Multiple-choice accuracy and byte perplexity of the local tasks, from the adapter's own answers."""
    hits = 0
    for question, choices, answer in QUESTIONS:
        scores = [lp for lp, _ in lm.loglikelihood([request("loglikelihood", question, " " + c) for c in choices])]
        hits += int(np.argmax(scores) == answer)
    texts = ["\n".join(LINES[i:]) for i in range(2)]
    total = sum(lm.loglikelihood_rolling([request("loglikelihood_rolling", t) for t in texts]))
    return hits / len(QUESTIONS), math.exp(-total / sum(len(t.encode()) for t in texts))


def test_local_tasks_through_simple_evaluate(lm, tasks_dir):
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    from nlearn.eval.harness import NlearnLM

    assert get_model("nlearn") is NlearnLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models stay registered
    out = lm_eval.simple_evaluate(model=lm, tasks=["nlearn_mc", "nlearn_ppl"],
                                  task_manager=TaskManager(include_path=tasks_dir, include_defaults=False))
    acc, byte_ppl = expected_metrics(lm)
    assert out["results"]["nlearn_mc"]["acc,none"] == pytest.approx(acc)
    assert out["results"]["nlearn_ppl"]["byte_perplexity,none"] == pytest.approx(byte_ppl, rel=1e-6)
    assert out["config"]["nlearn_rolling"] == "stream" and out["config"]["nlearn_cache_grows"] is False


def test_local_tasks_through_the_command_line(lm, run_dir, tasks_dir, tmp_path):
    """`nlearn-lm-eval` with lm-eval's own flags and the Hub switched off: the in-process numbers."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", JAX_PLATFORMS="cpu",
               HF_DATASETS_CACHE=str(tmp_path / "hf"))
    cli = os.path.join(os.path.dirname(sys.executable), "nlearn-lm-eval")
    proc = subprocess.run([cli, "--model", "nlearn", "--model_args", f"pretrained={run_dir},chunk_size=16",
                           "--tasks", "nlearn_mc,nlearn_ppl", "--include_path", tasks_dir,
                           "--output_path", str(tmp_path / "out")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    with open(path) as f:
        results = json.load(f)["results"]
    acc, byte_ppl = expected_metrics(lm)
    assert results["nlearn_mc"]["acc,none"] == pytest.approx(acc)
    assert results["nlearn_ppl"]["byte_perplexity,none"] == pytest.approx(byte_ppl, rel=1e-6)


def test_loglikelihood_is_a_difference_of_streamed_rollings(lm):
    context, continuation = "\n".join(LINES[:2]), " " + LINES[2]  # 180+ tokens: many 16-token chunks
    (logprob, greedy), = lm.loglikelihood([request("loglikelihood", context, continuation)])
    whole, head = lm.loglikelihood_rolling([request("loglikelihood_rolling", context + continuation),
                                            request("loglikelihood_rolling", context)])
    assert lm.tok_encode(context + continuation)[: len(lm.tok_encode(context))] == lm.tok_encode(context)
    assert logprob == pytest.approx(whole - head, rel=1e-5)
    assert logprob < 0 and isinstance(greedy, bool)


def test_window_rolling_scores_every_token_once(lm, monkeypatch):
    """Each window from a fresh state: the sum of the full forward's scores over the windows' new tokens."""
    from nlearn.train.step import token_losses

    monkeypatch.setattr(lm, "rolling", "window")
    monkeypatch.setattr(lm, "_max_length", 24)
    text = "\n".join(LINES)
    tokens = lm.tok_encode(text)
    windows = lm.rolling_windows(tokens)
    assert len(windows) > 3 and [t for _, cont in windows for t in cont] == tokens
    assert all(len(ctx) + len(cont) - 1 <= 24 for ctx, cont in windows)
    seqs = np.zeros((len(windows), 25), np.int32)  # each window right-padded: one forward for them all
    for row, (context, continuation) in enumerate(windows):
        seqs[row, : len(context) + len(continuation)] = context + continuation
    losses = np.asarray(token_losses(lm.scorer.streamer.graphdef, lm.scorer.streamer.params,
                                     seqs[:, :-1], seqs[:, 1:], np.float32))
    expected = -sum(float(losses[row, len(context) - 1: len(context) + len(continuation) - 1].sum())
                    for row, (context, continuation) in enumerate(windows))
    (rolled,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
    assert rolled == pytest.approx(expected, rel=1e-5)


def test_batch_sizes_and_request_order_give_the_same_answers(lm, monkeypatch):
    pairs = [(LINES[i % 3][: 10 + 7 * i], " " + LINES[(i + 1) % 3][: 3 + 11 * i]) for i in range(7)]
    pairs.append(("\n".join(LINES[:2]), " " + LINES[2]))  # longer than a chunk
    requests = [request("loglikelihood", c, x) for c, x in pairs]
    by_four = lm.loglikelihood(requests)
    reversed_four = lm.loglikelihood(requests[::-1])[::-1]
    monkeypatch.setattr(lm.scorer, "batch_size", 1)
    by_one = lm.loglikelihood(requests)
    assert by_four == reversed_four
    np.testing.assert_allclose([lp for lp, _ in by_one], [lp for lp, _ in by_four], rtol=1e-6)
    assert [g for _, g in by_one] == [g for _, g in by_four]
    singles = [lm.loglikelihood([r])[0][0] for r in requests[:3]]  # each alone: its own answer, in order
    np.testing.assert_allclose(singles, [lp for lp, _ in by_one[:3]], rtol=1e-6)


def test_stream_rolling_equals_nlearn_eval_perplexity(lm, run_dir, monkeypatch):
    """The held-out document (a line break, then text) through `--task=perplexity`'s full forward, and its
    text streamed after the same line break: the same mean loss over the same tokens."""
    from nlearn import data
    from nlearn.tasks.haystack import text_tokenizer
    from nlearn.eval.restore import load_run_config, restore_params
    from nlearn.eval.tasks import TaskContext, get_task

    config = load_run_config(run_dir)
    (document,) = [record["text"] for record in data.get_corpus(config).validation]
    document = document.decode() if isinstance(document, bytes) else document
    tokenizer = text_tokenizer(config)
    ids = tokenizer.encode(document).tolist()
    assert ids[0] == NEWLINE_ID and len(ids) <= config.train.seq_len
    with config.unlocked():
        config.data.eval_tokens = len(ids) - 1  # the document's tokens after its line break, no eos
    setup, step, params = restore_params(config, run_dir)
    result, _ = get_task("perplexity")(TaskContext(workdir=run_dir, config=config, setup=setup,
                                                   graphdef=setup.graphdef, params=params, step=int(step),
                                                   tokenizer=tokenizer))
    assert result["tokens"] == len(ids) - 1
    monkeypatch.setattr(lm, "_prefix", NEWLINE_ID)
    (rolled,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", document[1:])])
    assert -rolled / (len(ids) - 1) == pytest.approx(result["loss"], rel=1e-5)


def test_generate_until_stops_at_the_first_until_string(lm, monkeypatch):
    # A context that with its prefix fills whole 16-token chunks: the prefill compiles one shape.
    context = next(LINES[0][:n] for n in range(20, len(LINES[0])) if (len(lm.tok_encode(LINES[0][:n])) + 1) % 16 == 0)
    free = lm.generate(context, {"max_gen_toks": 12})
    assert len(free) >= 8, free
    first, later = free[4:6], free[6:8]
    calls = []
    prefill = lm.scorer.streamer.prefill
    monkeypatch.setattr(lm.scorer.streamer, "prefill", lambda *a: calls.append(1) or prefill(*a))
    stopped = lm.generate(context, {"until": [later, first], "max_gen_toks": 12})
    assert stopped == free[: free.index(first)]  # cut before the string that comes first in the text
    assert len(calls) < 12  # and decoding stopped there: a prefill, then fewer than 11 single tokens
    (via_requests,) = lm.generate_until([request("generate_until", context, {"until": [first], "max_gen_toks": 12})])
    assert via_requests == stopped
    sampled = lm.generate(context, {"do_sample": True, "temperature": 1.0, "max_gen_toks": 6})
    assert sampled == lm.generate(context, {"do_sample": True, "temperature": 1.0, "max_gen_toks": 6})


def test_bad_arguments_are_one_line_user_errors(lm, run_dir, tmp_path, monkeypatch):
    import jax

    from nlearn.eval.harness import NlearnLM

    with pytest.raises(UserError, match="not a run directory"):
        NlearnLM(pretrained=str(tmp_path))
    with pytest.raises(UserError, match="rolling='windows'"):
        NlearnLM(pretrained=run_dir, rolling="windows")
    with pytest.raises(UserError, match="unknown nlearn model argument.*steps"):
        NlearnLM(pretrained=run_dir, steps=3)
    with pytest.raises(UserError, match="exactly one of"):
        NlearnLM()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(UserError, match="runs in one process; this job has 2"):
        NlearnLM(pretrained=run_dir)
