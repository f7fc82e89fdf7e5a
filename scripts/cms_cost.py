"""What the CMS's in-context learning costs: a Hope `tiny` training step with `cms.update=ntp`
against the same model with `cms.update=none` on the same batch (the two passes included), and a
`titans_lmm:tiny` step, timed in one run; then where the ntp step's time goes (pass 1 alone).

    python scripts/cms_cost.py                              # the tiny presets' batch (16 x 256)
    python scripts/cms_cost.py --batch=4 --seq_len=128 --n=3 --set=hope.mixer=attention

Times are medians of `--n` steps after a compile and a warm-up (`nlearn.bench.time_fn`), wall and
CPU; the bar is ntp <= 3x none.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from nlearn.bench import fmt, markdown_table, time_fn  # noqa: E402
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
    step = jax.jit(make_train_step(setup.graphdef, setup.optimizer, grad_accum=1, dtype=setup.dtype))
    return setup, step, setup.init_state()


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
    timings, ntp_setup = {}, None
    for name, family, overrides in cases:
        setup, step, state = step_and_state(config_of(family, overrides, args.batch, args.seq_len))
        ntp_setup = ntp_setup or (setup, state)
        timings[name] = time_fn(step, state, batch, n=args.n)
        print(f"{name}: {timings[name].median:.3f} s/step (compile {timings[name].compile_s:.1f} s)", flush=True)

    setup, state = ntp_setup
    adapt = jax.jit(lambda params, x: nnx.merge(setup.graphdef, params).adapt(x))
    timings["hope ntp: pass 1 alone"] = time_fn(adapt, state["params"], batch["inputs"], n=args.n)

    none = timings["hope none"].median
    rows = [[name, fmt(t.median, 3), fmt(t.cpu_median, 3), fmt(t.median / none, 2),
             fmt(t.median / timings["titans_lmm"].median, 2)] for name, t in timings.items()]
    print(f"\nbatch {args.batch} x {args.seq_len}, backend {jax.default_backend()}, overrides {sets or 'none'}")
    print(markdown_table(["step", "wall s", "cpu s", "/ hope none", "/ titans_lmm"], rows))
    ratio = timings["hope ntp"].median / none
    print(f"\nntp / none = {ratio:.2f} ({'within' if ratio <= 3 else 'OVER'} the 3x budget); "
          f"ntp / titans_lmm = {timings['hope ntp'].median / timings['titans_lmm'].median:.2f}")


if __name__ == "__main__":
    main()
