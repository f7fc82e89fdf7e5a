"""Peak resident memory of scoring one random prompt of LENGTH tokens with configs/FAMILY.py:tiny, streamed
in chunks of 512 then 8 greedy tokens: `python peak_memory.py FAMILY LENGTH` prints one JSON line.

Run in a fresh process per length (ru_maxrss is the process' peak); the chunk step is compiled and run on a
short prompt first, so both lengths' peaks include the same compilation."""

import json
import resource
import sys
import time

import numpy as np

from eval_helpers import load_family_config, split_model  # noqa: E402
from nlearn.eval.streaming import Streamer


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(family: str, length: int) -> None:
    config = load_family_config(family)
    with config.unlocked():
        config.data.vocab_size = 1024
    graphdef, params = split_model(config)
    streamer = Streamer(graphdef, params, chunk_size=512)
    rng = np.random.default_rng(0)
    streamer.complete(rng.integers(0, 1024, 1024 + 100).tolist(), 8)  # compile: full chunk, tail, one token
    before, start = rss_mb(), time.perf_counter()
    reply = streamer.complete(rng.integers(0, 1024, length).tolist(), 8)
    print(json.dumps({"family": family, "length": length, "rss_before_mb": round(before, 1),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "seconds": round(time.perf_counter() - start, 1), "reply_tokens": len(reply)}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
