"""Time per 1,000 lm-eval `loglikelihood` requests through the nlearn adapter (nlearn.eval.harness), an
initialised `configs/FAMILY.py:PRESET` model on the built-in corpus' tokenizer, by batch size:

    python benchmarks/lm_eval_loglikelihood.py --family=titans_lmm --requests=1000 --batch_sizes=1,8,32

Requests look like a multiple-choice task's: a context of 20-120 words of held-out text and a continuation of
1-6 words. Each batch size is timed twice: the first pass compiles (one shape per length bucket), the second
is the steady state. Prints a markdown table; a sub-linear growth with the batch size is the batching at work.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def family_config(family: str, preset: str):
    path = os.path.join(ROOT, "configs", f"{family}.py")
    spec = importlib.util.spec_from_file_location(f"nlearn_config_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def make_requests(words, n: int, seed: int):
    import numpy as np
    from lm_eval.api.instance import Instance

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        start = int(rng.integers(0, len(words) - 200))
        n_ctx, n_cont = int(rng.integers(20, 121)), int(rng.integers(1, 7))
        context = " ".join(words[start: start + n_ctx])
        continuation = " " + " ".join(words[start + n_ctx: start + n_ctx + n_cont])
        out.append(Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=i))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="titans_lmm")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--batch_sizes", default="1,8,32")
    parser.add_argument("--chunk_size", type=int, default=256)
    args = parser.parse_args()

    from flax import nnx

    from nlearn import models
    from nlearn.tasks.haystack import haystack_words, text_tokenizer
    from nlearn.eval.harness import NlearnLM

    config = family_config(args.family, args.preset)
    tokenizer = text_tokenizer(config)
    graphdef, params = nnx.split(models.build(config), nnx.Param)
    params = nnx.to_pure_dict(params)
    requests = make_requests(haystack_words(config, "validation"), args.requests, seed=0)
    tokens = sum(len(tokenizer.encode(r.args[0] + r.args[1])) + 1 for r in requests)
    print(f"{args.family}:{args.preset}, {args.requests} requests ({tokens / args.requests:.0f} tokens each on "
          f"average), chunk {args.chunk_size}; {platform.node()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}\n")
    print("| batch size | first pass (compiles), s | steady state, s per 1K requests | tokens/s |")
    print("|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        lm = NlearnLM(model=(graphdef, params), tokenizer=tokenizer, batch_size=batch, chunk_size=args.chunk_size)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            lm.loglikelihood(requests, disable_tqdm=True)
            times.append(time.perf_counter() - start)
        per_1k = times[1] * 1000 / args.requests
        print(f"| {batch} | {times[0]:.1f} | {per_1k:.1f} | {tokens / times[1]:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
