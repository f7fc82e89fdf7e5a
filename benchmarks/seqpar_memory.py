"""What sequence parallelism buys: one `deltanet` train step on a single 1M-token sequence (tiny
width), compiled for one device and for `--devices` host devices splitting the sequence
(`mesh.sequence`), with XLA's per-device memory figures (`compiled.memory_analysis()`) and the
collectives in the split step's compiled HLO; `--run` then trains that step on the split devices.

    python benchmarks/seqpar_memory.py                        # 2^20 tokens over 8 devices, figures only
    python benchmarks/seqpar_memory.py --run --write          # ... train the step, write results/seqpar.md

The forced host devices share this machine's memory, so "one device's budget" is `--budget_gib`
per device: the step fits when its per-device peak (arguments + outputs + temporaries − donated
buffers) is within it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1 << 20, help="length of the one training sequence")
    p.add_argument("--devices", type=int, default=8, help="host devices splitting it (mesh.sequence)")
    p.add_argument("--d_model", type=int, default=16)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--budget_gib", type=float, default=1.0, help="memory budget of one device")
    p.add_argument("--run", action="store_true", help="also train the step on the split devices")
    p.add_argument("--write", action="store_true", help="write results/seqpar.md")
    return p.parse_args(argv)


ARGS = parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}")  # before jax loads
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from timing import markdown_table  # noqa: E402
from nlearn.config import validate  # noqa: E402
from nlearn.train.state import make_setup  # noqa: E402
from nlearn.train.step import make_train_step  # noqa: E402

COLLECTIVES = ("all-gather", "collective-permute", "all-reduce", "reduce-scatter", "all-to-all")
MIB = float(1 << 20)


def config_of(args, sequence: int):
    import deltanet

    config = deltanet.get_config("tiny")
    config.model.update(d_model=args.d_model, num_layers=args.layers, num_heads=2)
    config.data.vocab_size = args.vocab
    config.train.update(batch_size=1, seq_len=args.tokens)
    config.mesh.update(data=1 if sequence > 1 else -1, sequence=sequence)  # one device: only shapes are used
    validate(config)
    return config


def per_device(compiled) -> dict:
    """XLA's per-device memory figures of a compiled step, in MiB."""
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"arguments": m.argument_size_in_bytes / MIB, "temporaries": m.temp_size_in_bytes / MIB, "peak": peak / MIB}


def collective_counts(hlo: str) -> dict:
    """Collective ops in compiled HLO text (an async pair `*-start`/`*-done` counts once)."""
    return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo)) for op in COLLECTIVES}


def batch_of(tokens: int, vocab: int) -> dict:
    ids = np.random.default_rng(0).integers(0, vocab, (1, tokens + 1), dtype=np.int32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}


def compile_single(config):
    """The step as one device runs it (no mesh): abstract state and batch, compiled."""
    setup = make_setup(config)
    step = jax.jit(make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=setup.dtype),
                   donate_argnums=0)
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), setup.abstract_state)
    batch = {k: jax.ShapeDtypeStruct((1, config.train.seq_len), jnp.int32) for k in ("inputs", "targets")}
    return step.lower(plain, batch).compile()


def compile_split(config):
    """The trainer's step on the `sequence` mesh, traced under it (so the layers split the sequence)."""
    setup = make_setup(config)
    step = jax.jit(make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=setup.dtype),
                   in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)
    batch = {k: jax.ShapeDtypeStruct((1, config.train.seq_len), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets")}
    with jax.set_mesh(setup.mesh):
        compiled = step.lower(setup.abstract_state, batch).compile()
    return setup, compiled


def main(args) -> None:
    rows, began = [], time.perf_counter()
    single = per_device(compile_single(config_of(args, 1)))
    budget = args.budget_gib * 1024
    row = lambda name, m: [name, f"{m['arguments']:.1f}", f"{m['temporaries']:.1f}", f"{m['peak']:.1f}",  # noqa: E731
                           "yes" if m["peak"] <= budget else "no"]
    rows.append(row("1 device", single))
    setup, compiled = compile_split(config_of(args, args.devices))
    split = per_device(compiled)
    rows.append(row(f"{args.devices} devices (mesh.sequence={args.devices}), each", split))
    counts = collective_counts(compiled.as_text())
    print(f"compiled both in {time.perf_counter() - began:.0f} s", flush=True)
    table = markdown_table(["step on one sequence", "arguments MiB", "temporaries MiB", "peak MiB",
                            f"fits {args.budget_gib:g} GiB"], rows)
    count_table = markdown_table(["collective in the split step's HLO", "count"], list(counts.items()))
    print(table + "\n\n" + count_table, flush=True)
    ran = ""
    if args.run:
        state = setup.init_state()
        batch = setup.put_batch(batch_of(args.tokens, args.vocab))
        t0 = time.perf_counter()
        with jax.set_mesh(setup.mesh):
            state, metrics = compiled(state, batch)
        loss = float(metrics["loss"])
        seconds = time.perf_counter() - t0
        ran = (f"`--run`: the split step trained on the {args.tokens:,}-token sequence in {seconds:.1f} s "
               f"(load average {os.getloadavg()[0]:.0f} on the machine), loss {loss:.4f} "
               f"(ln {args.vocab} = {np.log(args.vocab):.4f} at init).")
        print(ran, flush=True)
    if args.write:
        from results_md import write_results

        ratio = single["peak"] / split["peak"]
        fwd = 2 * (args.devices - 1).bit_length() + 3  # permutes of one layer's forward
        note = (f"`deltanet`, d_model={args.d_model}, {args.layers} layer(s), 2 heads, vocab {args.vocab}, one "
                f"sequence of {args.tokens:,} tokens, float32, AdamW step. Figures are XLA's per-device "
                f"`memory_analysis()` of the compiled step (peak = arguments + outputs + temporaries − donated); "
                f"splitting the sequence over {args.devices} devices divides the per-device peak by {ratio:.1f}. "
                f"{ran}\n\nCollectives of the split step, per memory layer: the forward has 3 conv halos (one "
                f"`collective-permute` each), ⌈log2 P⌉ scan rounds of the state maps (A and B: two permutes a round, "
                f"but the last round's A is unused and dropped) and one shift of the incoming state, 2⌈log2 P⌉ + 3 "
                f"in all ({fwd} for P = {args.devices}); the backward transposes each one: {2 * fwd * args.layers} "
                f"expected for {args.layers} layer(s), {counts['collective-permute']} compiled. The `all-reduce` sums "
                f"the parameters' gradients over the devices (XLA combines them).")
        args_text = " ".join(a for a in sys.argv[1:])
        path = write_results("seqpar.md", "Sequence parallelism: per-device memory and collectives",
                             f"python benchmarks/seqpar_memory.py {args_text}".strip(), table + "\n\n" + count_table,
                             note)
        print(f"wrote {path}")


if __name__ == "__main__":
    main(ARGS)
