"""Peak resident memory of scoring one random prompt of LENGTH tokens with configs/FAMILY.py:tiny, streamed
in chunks of 512 then 8 greedy tokens: `python peak_memory.py FAMILY LENGTH` prints one JSON line. With a
third argument `rolling`, the prompt is instead scored as lm-eval's stream-mode `loglikelihood_rolling` scores
a document (nlearn.eval.scoring.Scorer.document: every token's log-probability, no generation).

Run in a fresh process per length (ru_maxrss is the process' peak); the chunk step is compiled and run on a
short prompt first, so both lengths' peaks include the same compilation."""

import json
import resource
import sys
import time

import numpy as np

from eval_helpers import load_family_config, split_model  # noqa: E402
from nlearn.eval.scoring import Scorer
from nlearn.eval.streaming import Streamer


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(family: str, length: int, mode: str = "complete") -> None:
    config = load_family_config(family)
    with config.unlocked():
        config.data.vocab_size = 1024
    graphdef, params = split_model(config)
    rng = np.random.default_rng(0)
    if mode == "rolling":
        scorer = Scorer(graphdef, params, chunk_size=512)
        run = lambda tokens: len(scorer.document(tokens)[0])  # noqa: E731  (tokens scored)
    else:
        streamer = Streamer(graphdef, params, chunk_size=512)
        run = lambda tokens: len(streamer.complete(tokens, 8))  # noqa: E731  (reply tokens)
    run(rng.integers(0, 1024, 1024 + 100).tolist())  # compile: full chunk, tail, one token
    before, start = rss_mb(), time.perf_counter()
    produced = run(rng.integers(0, 1024, length).tolist())
    print(json.dumps({"family": family, "length": length, "mode": mode, "rss_before_mb": round(before, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "seconds": round(time.perf_counter() - start, 1),
                      ("scored_tokens" if mode == "rolling" else "reply_tokens"): produced}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
