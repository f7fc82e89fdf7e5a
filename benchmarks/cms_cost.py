"""What the CMS's in-context learning costs: a Hope `tiny` training step with `cms.update=ntp`
against the same model with `cms.update=none` on the same batch (the two passes included), and a
`titans_lmm:tiny` step, timed in one run; then where the ntp step's time goes (pass 1 alone).

    python benchmarks/cms_cost.py                              # the tiny presets' batch (16 x 256)
    python benchmarks/cms_cost.py --batch=4 --seq_len=128 --n=3 --set=hope.mixer=attention

Every case is compiled and warmed up first, then the cases are timed in turns for `--n` rounds (a
changing load slows them alike); medians, wall and CPU. The bar is ntp <= 3x none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from timing import Timing, fmt, markdown_table  # noqa: E402
from nlearn.config import validate  # noqa: E402
from nlearn.train.state import make_setup  # noqa: E402
from nlearn.train.step import make_train_step  # noqa: E402


def config_of(family: str, overrides: dict, batch: int, seq_len: int):
    config = importlib.import_module(family).get_config("tiny")
    with config.unlocked():
        config.train.update(batch_size=batch, seq_len=seq_len)
        for key, value in overrides.items():
            *path, name = key.split(".")
            section = config.model
            for part in path:
                section = section[part]
            section[name] = value
    validate(config)
    return config


def step_and_state(config):
    setup = make_setup(config)
    step = jax.jit(make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=setup.dtype))
    return setup, step, setup.init_state()


def interleaved(calls: dict, n: int) -> dict:
    """Compile and warm up every `name: (jitted fn, args)`, then time them in turns, `n` rounds, so a
    machine whose load changes slows every case alike. `{name: Timing}` (medians over the rounds)."""
    compiled, compile_s = {}, {}
    for name, (fn, args) in calls.items():
        t0 = time.perf_counter()
        compiled[name] = fn.lower(*args).compile()
        compile_s[name] = time.perf_counter() - t0
        jax.block_until_ready(compiled[name](*args))
        print(f"{name}: compiled in {compile_s[name]:.1f} s", flush=True)
    walls, cpus = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(max(1, n)):
        for name, (_, args) in calls.items():
            c0, w0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            walls[name].append(time.perf_counter() - w0)
            cpus[name].append(time.process_time() - c0)
    return {name: Timing(statistics.median(walls[name]), min(walls[name]), statistics.median(cpus[name]),
                         compile_s[name], walls[name]) for name in calls}


def parse_sets(items) -> dict:
    out = {}
    for item in items:
        key, value = item.split("=", 1)
        try:
            out[key] = eval(value, {})  # numbers, tuples, booleans
        except (NameError, SyntaxError):
            out[key] = value
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--n", type=int, default=5, help="timed steps per case")
    parser.add_argument("--set", action="append", default=[], help="model override for both Hope cases, "
                        "e.g. hope.mixer=attention or cms.periods=(8,32)")
    args = parser.parse_args()
    sets = parse_sets(args.set)
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq_len + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32)}

    cases = [("hope ntp", "hope", dict(sets, **{"cms.update": "ntp"})),
             ("hope none", "hope", dict(sets, **{"cms.update": "none"})),
             ("titans_lmm", "titans_lmm", {})]
    calls, ntp_setup = {}, None
    for name, family, overrides in cases:
        setup, step, state = step_and_state(config_of(family, overrides, args.batch, args.seq_len))
        ntp_setup = ntp_setup or (setup, state)
        calls[name] = (step, (state, batch))
    setup, state = ntp_setup
    adapt = jax.jit(lambda params, x: nnx.merge(setup.graphdef, params).adapt(x))
    calls["hope ntp: pass 1 alone"] = (adapt, (state["params"], batch["inputs"]))
    timings = interleaved(calls, args.n)
    none, lmm = timings["hope none"], timings["titans_lmm"]
    rows = [[name, fmt(t.median, 3), fmt(t.cpu_median, 3), fmt(t.median / none.median, 2),
             fmt(t.median / lmm.median, 2), fmt(t.compile_s, 0)] for name, t in timings.items()]
    print(f"\nbatch {args.batch} x {args.seq_len}, backend {jax.default_backend()}, overrides {sets or 'none'}")
    print(markdown_table(["step", "wall s", "cpu s", "/ hope none", "/ titans_lmm", "compile s"], rows))
    ntp = timings["hope ntp"]
    ratio = ntp.median / none.median
    print(f"\nntp / none = {ratio:.2f} wall, {ntp.cpu_median / none.cpu_median:.2f} CPU "
          f"({'within' if ratio <= 3 else 'OVER'} the 3x budget); ntp / titans_lmm = {ntp.median / lmm.median:.2f}; "
          f"pass 1 = {timings['hope ntp: pass 1 alone'].median / ntp.median:.0%} of the ntp step")

if __name__ == "__main__":
    main()
