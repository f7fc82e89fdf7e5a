"""Streaming keeps memory constant with length for a memory family: a 64K-token prompt is scored with peak
RSS within 1.5x of a 4K-token one (titans_lmm tiny, each in a fresh process). Measured on 2 loaded cores:
714 MB at 4K, 715 MB at 64K (74 s for the 64K prompt)."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def peak(family: str, length: int, mode: str = "complete") -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [HERE, os.path.dirname(os.path.dirname(HERE)), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "peak_memory.py"), family, str(length), mode],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_titans_lmm_scores_64k_tokens_in_the_memory_of_4k():
    short, long = peak("titans_lmm", 4096), peak("titans_lmm", 65536)
    print(json.dumps([short, long]))
    assert long["reply_tokens"] == short["reply_tokens"] == 8
    assert long["peak_rss_mb"] <= 1.5 * short["peak_rss_mb"], (short, long)
    # and the stream itself adds little: 64K x 1024 float32 logits alone would be 256 MB
    assert long["peak_rss_mb"] - long["rss_before_mb"] < 100, long


@pytest.mark.slow
def test_titans_lmm_stream_rolling_scores_16k_tokens_in_the_memory_of_2k():
    """lm-eval's stream-mode `loglikelihood_rolling` (nlearn.eval.harness) on a 16K-token document."""
    short, long = peak("titans_lmm", 2048, "rolling"), peak("titans_lmm", 16384, "rolling")
    print(json.dumps([short, long]))
    assert (short["scored_tokens"], long["scored_tokens"]) == (2047, 16383)
    assert long["peak_rss_mb"] <= 1.5 * short["peak_rss_mb"], (short, long)
