"""Compile a config's real train step for a TPU topology (or this machine's CPUs) without the hardware:
per-device memory against the chip's HBM, FLOPs, a roofline step time, the collectives.

The step is `nlearn-train`'s own (`make_setup`, the plain step hook: model, optimizer, sharding rules,
remat, scan_layers, dtype); only the mesh is built over the topology's devices, and the state and batch
enter as `jax.ShapeDtypeStruct`s carrying their shardings, so no parameter is allocated. libtpu (the
`nlearn[tpu]` extra) compiles for TPUs on any machine (`jax.experimental.topologies`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time

import jax
import jax.numpy as jnp

from nlearn.errors import UserError
from nlearn.train import flops as flops_lib
from nlearn.train import hlo
from nlearn.train import mesh as mesh_lib

GIB = 1024**3
# libtpu locks /tmp/libtpu_lockfile for the process that drives the chips; compiling drives none, so several
# compiles (or a test run with pytest -n 2) may load it at once. Set before jax loads its plugins.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


@dataclasses.dataclass(frozen=True)
class Chip:
    hbm_bytes: float
    peak_bf16_flops: float  # per chip, FLOP/s
    hbm_bytes_per_s: float


# Published per-chip figures, Google Cloud TPU documentation (cloud.google.com/tpu/docs/v4, /v5e, /v5p,
# /v6e: "System architecture" tables): HBM capacity, peak bf16 compute, HBM bandwidth.
CHIPS = {
    "v4": Chip(32 * GIB, 275e12, 1228e9),
    "v5e": Chip(16 * GIB, 197e12, 819e9),
    "v5p": Chip(95 * GIB, 459e12, 2765e9),
    "v6e": Chip(32 * GIB, 918e12, 1640e9),
}
INSTALL_HINT = "compiling for a TPU topology needs libtpu: pip install 'nlearn[tpu]' (or make setup)"


def topology_devices(topology: str):
    """`(devices, chip name or None)` of `topology`: "cpu" (this machine's CPU devices) or "<chip>:<AxBxC>"
    (e.g. v5e:4x4, v5p:2x2x1, v4:2x2x1)."""
    if topology == "cpu":
        return jax.devices("cpu"), None
    chip, sep, shape = topology.partition(":")
    if not sep or chip not in CHIPS or not re.fullmatch(r"\d+(x\d+){1,2}", shape):
        raise UserError(f"--topology={topology!r}: expected cpu or <chip>:<AxB[xC]> with chip one of "
                        f"{', '.join(CHIPS)} (e.g. v5e:4x4, v5p:2x2x1)")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise UserError(INSTALL_HINT) from None
    from jax.experimental import topologies

    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "")  # nothing to detect: we only compile
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu's message names what it did not accept
        raise UserError(f"--topology={topology!r}: libtpu refused it: {str(e).splitlines()[0]}") from None
    return desc.devices, chip


def per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs with shardings (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


@dataclasses.dataclass
class Report:
    """What one compile found; bytes and FLOPs are per device and per step."""

    family: str
    topology: str
    devices: int
    mesh: dict
    batch: int
    seq_len: int
    dtype: str
    n_params: int
    param_bytes: int
    opt_bytes: int
    fits: bool | None  # None: no HBM figure (CPU)
    hbm_bytes: float | None
    argument_bytes: float | None = None
    temp_bytes: float | None = None
    output_bytes: float | None = None
    alias_bytes: float | None = None
    xla_flops: float | None = None  # cost_analysis(): loop bodies counted once
    hlo_matmul_flops: float | None = None  # the lowered program's dots times their loops' trip counts, / devices
    model_matmul_flops: float | None = None  # the same without remat's recompute (what flops.py counts)
    unknown_loops: int = 0
    bytes_accessed: float | None = None
    analytic_flops: float = 0.0  # nlearn.train.flops, per device
    collectives: dict = dataclasses.field(default_factory=dict)
    compile_s: float = 0.0
    error: str = ""  # the compiler's refusal (e.g. out of HBM)
    largest: list = dataclasses.field(default_factory=list)  # the largest buffers (XLA's, else the program's arrays)
    device_arrays: list = dataclasses.field(default_factory=list)  # the compiled program's largest, per device
    serial_passes: int = 0  # Hope's pass 1: sequential whole-model passes per micro-batch (0: none)
    serial_bytes: float = 0.0  # their HBM traffic per device and step, a lower bound (the family's serial_traffic)

    @property
    def total_bytes(self) -> float | None:
        if self.temp_bytes is None:
            return None
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def step_time(self, chip: Chip | None) -> float | None:
        """Roofline: the larger of the matmul FLOPs at peak and XLA's bytes accessed at HBM bandwidth, plus
        Hope's sequential pass 1 at HBM bandwidth (memory-bound, and done before the rest can start)."""
        if chip is None or self.hlo_matmul_flops is None:
            return None
        return (max(self.hlo_matmul_flops / chip.peak_bf16_flops, (self.bytes_accessed or 0) / chip.hbm_bytes_per_s)
                + self.serial_bytes / chip.hbm_bytes_per_s)

    def serial_time(self, chip: Chip | None) -> float | None:
        """Hope's pass 1 alone at HBM bandwidth (None without one or without a chip)."""
        return None if chip is None or not self.serial_passes else self.serial_bytes / chip.hbm_bytes_per_s

    def mfu(self, chip: Chip | None) -> float | None:
        t = self.step_time(chip)
        return None if not t else self.analytic_flops / (t * chip.peak_bf16_flops)


def _oom_details(message: str) -> tuple[float | None, list[str]]:
    """From XLA's out-of-memory message: the bytes the program asked for, and its largest allocations."""
    used = re.search(r"Used ([\d.]+)([KMGT])? of", message) or re.search(r"temporaries \(([\d.]+)([KMGT])\)", message)
    scale = {None: 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    need = float(used.group(1)) * scale[used.group(2)] if used else None
    largest = []
    pattern = r"\d+\. Size: ([\d.]+[KMGT]?)\n(?:.*\n)*?\s*Operator: (.*)\n(?:.*\n)*?\s*Shape: (\S+)"
    for m in re.finditer(pattern, message):
        op = re.search(r'op_name="([^"]+)"', m.group(2))
        largest.append(f"{m.group(1)} {m.group(3)} ({op.group(1) if op else m.group(2).strip()[:80]})")
        if len(largest) == 5:
            break
    return need, largest


def _step(config, devices):
    """`(setup, the jitted train step, the abstract batch)` of `config` over `devices`."""
    from nlearn.train.hooks import StepHook
    from nlearn.train.state import make_setup

    setup = make_setup(config, devices=devices)
    t = config.train
    jitted = StepHook(config, "", True).jitted_step(setup)  # the plain run's step; XLA's defaults for the target
    batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32, sharding=setup.batch_sharding)
             for k in ("inputs", "targets")}
    return setup, jitted, batch


def _arrays(hlo_text: str, k: int, where: str = "") -> list[str]:
    """The program's `k` largest arrays as `shape (GiB[where], op)`."""
    return [f"{shape} ({b / GIB:.2f} GiB{where}{'' if op == '?' else ', ' + op})"
            for b, shape, op in hlo.largest_arrays(hlo_text, k)]


def _largest(lowered, n: int) -> list[str]:
    """The lowered program's largest arrays, whole-batch shapes."""
    return _arrays(lowered.as_text(dialect="hlo"), 5, f" before splitting over {n} devices")


def compile_step(config, topology: str = "cpu") -> Report:
    """Lower and compile `config`'s train step for `topology`; a `Report` (out of HBM included)."""
    from nlearn import config as config_lib

    config_lib.validate(config)
    devices, chip_name = topology_devices(topology)
    chip = CHIPS.get(chip_name)
    setup, jitted, batch = _step(config, devices)
    t = config.train
    n = len(devices)
    analytic = flops_lib.flops_per_token(config.model, setup.abstract_state["params"], t.seq_len,
                                         backend="tpu" if chip else "cpu") * t.batch_size * t.seq_len / n
    report = Report(config.model.family, topology, n, dict(setup.mesh.shape), t.batch_size, t.seq_len,
                    config.model.dtype, setup.n_params, per_device_bytes(setup.abstract_state["params"]),
                    per_device_bytes(setup.abstract_state["opt_state"]), None, chip.hbm_bytes if chip else None,
                    analytic_flops=analytic)
    from nlearn.models import FAMILIES

    serial_traffic = FAMILIES[config.model.family].serial_traffic
    if serial_traffic is not None:
        shards = report.mesh.get("data", 1) * report.mesh.get("fsdp", 1)
        per_device = max(1, t.batch_size // (t.grad_accum * shards))
        report.serial_passes, serial = serial_traffic(config.model, setup.n_params, t.seq_len, per_device)
        report.serial_bytes = serial * t.grad_accum
    began, lowered = time.perf_counter(), None
    try:
        lowered = mesh_lib.in_mesh_context(lambda: jitted.lower(setup.abstract_state, batch), setup.mesh,
                                           setup.batch_sharding)()
        flops, report.unknown_loops = hlo.matmul_flops(lowered.as_text(dialect="hlo"))
        report.hlo_matmul_flops = flops / n  # the whole program's, before partitioning: split over the devices
        report.model_matmul_flops = report.hlo_matmul_flops
        if config.model.remat:  # the model's own FLOPs (what flops.py counts): the same step without remat
            plain = config.copy_and_resolve_references()
            with plain.unlocked():
                plain.model.remat = False
            _, plain_jitted, _ = _step(plain, devices)
            plain_lowered = mesh_lib.in_mesh_context(lambda: plain_jitted.lower(setup.abstract_state, batch),
                                                     setup.mesh, setup.batch_sharding)()
            report.model_matmul_flops = hlo.matmul_flops(plain_lowered.as_text(dialect="hlo"))[0] / n
        compiled = lowered.compile()
    except Exception as e:  # XLA refuses a program that does not fit the chip's HBM
        message = str(e)
        if lowered is None or ("RESOURCE_EXHAUSTED" not in message and "exceeds available" not in message):
            raise
        report.compile_s = time.perf_counter() - began
        report.fits, report.error = False, message.splitlines()[0][:300]
        need, largest = _oom_details(message)
        report.largest = largest or _largest(lowered, n)  # XLA's message names none: the program's own
        if need is not None:
            report.temp_bytes, report.argument_bytes, report.output_bytes, report.alias_bytes = need, 0.0, 0.0, 0.0
        return report
    report.compile_s = time.perf_counter() - began
    mem = compiled.memory_analysis()
    report.argument_bytes, report.temp_bytes = float(mem.argument_size_in_bytes), float(mem.temp_size_in_bytes)
    report.output_bytes, report.alias_bytes = float(mem.output_size_in_bytes), float(mem.alias_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    report.xla_flops = float(cost.get("flops", 0.0))
    report.bytes_accessed = float(cost.get("bytes accessed", 0.0))
    compiled_text = compiled.as_text()
    report.collectives = hlo.collectives(compiled_text)
    report.device_arrays = _arrays(compiled_text, 3)
    if chip:
        report.fits = report.total_bytes <= chip.hbm_bytes
    if report.fits is False:  # compiled, but over the chip's HBM: name the program's largest arrays
        report.error = f"{_gib(report.total_bytes)} per device exceeds the chip's {_gib(chip.hbm_bytes)} HBM"
        report.largest = _largest(lowered, n)
    return report


def fitting_grad_accum(config, topology: str, refused: Report, log=print):
    """`(train.grad_accum, Report)` of the first micro-batching that fits where `refused` (config's own report)
    ran out of HBM, else of the smallest micro-batch tried (its report says by how much it misses). The global
    batch stays; the micro-batch shrinks by a power of two, the first guess from the temporaries XLA asked for
    (they scale with the micro-batch), each guess compiled to confirm. None: nothing to try."""
    chip = CHIPS.get(topology.partition(":")[0])
    t = config.train
    shards = refused.mesh.get("data", 1) * refused.mesh.get("fsdp", 1)  # the batch is split over both
    if chip is None or refused.temp_bytes is None or t.batch_size % shards:
        return None
    room = chip.hbm_bytes - refused.param_bytes - refused.opt_bytes
    factor = 2 ** max(1, math.ceil(math.log2(max(refused.temp_bytes / max(room, 1.0), 1.0))))
    accum = t.grad_accum * factor
    while t.batch_size % (accum * shards) and accum > t.grad_accum * 2:  # at most one sequence per shard
        accum //= 2
    last = None
    while t.batch_size % (accum * shards) == 0:
        trial = config.copy_and_resolve_references()
        with trial.unlocked():
            trial.train.grad_accum = accum
        report = compile_step(trial, topology)
        per_chip = t.batch_size // (accum * shards)
        log(f"train.grad_accum={accum} ({per_chip} sequence{'s' if per_chip > 1 else ''} per batch shard per "
            "micro-batch): "
            + ("fits" if report.fits else f"does not fit ({_gib(report.total_bytes)})"))
        last = accum, report
        if report.fits:
            break
        accum *= 2
    return last


def _gib(x) -> str:
    return "?" if x is None else f"{x / GIB:.2f} GiB"


def describe(report: Report) -> str:
    """The printed report: memory, FLOPs, step time, collectives; a one-line refusal when it does not fit."""
    chip = CHIPS.get(report.topology.partition(":")[0])
    lines = [f"{report.family} ({report.n_params / 1e6:.1f}M parameters) on {report.topology}: {report.devices} "
             f"devices, mesh {report.mesh}, batch {report.batch} x {report.seq_len}, {report.dtype}",
             f"memory per device: parameters {_gib(report.param_bytes)}, optimizer state {_gib(report.opt_bytes)}, "
             f"arguments {_gib(report.argument_bytes)}, temporaries {_gib(report.temp_bytes)}, "
             f"outputs {_gib(report.output_bytes)} (aliased {_gib(report.alias_bytes)}), "
             f"total {_gib(report.total_bytes)}" + (f" of {_gib(report.hbm_bytes)} HBM" if report.hbm_bytes else "")]
    if report.hlo_matmul_flops is None:
        return "\n".join(lines)
    ratio = report.model_matmul_flops / report.analytic_flops if report.analytic_flops else float("nan")
    unknown = f"; {report.unknown_loops} of unknown length counted once" if report.unknown_loops else ""
    lines.append(f"FLOPs per device per step: {report.hlo_matmul_flops:.3e} in the program's matmuls (loops counted "
                 f"by trip count, remat's recompute included{unknown}), XLA cost_analysis {report.xla_flops or 0:.3e} "
                 f"(loop bodies once); without remat {report.model_matmul_flops:.3e}, nlearn.train.flops "
                 f"{report.analytic_flops:.3e} (ratio {ratio:.2f})")
    if chip:
        t = report.step_time(chip)
        lines.append(f"estimated step time {t * 1e3:.1f} ms (roofline: {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, "
                     f"{chip.hbm_bytes_per_s / 1e9:.0f} GB/s HBM; collectives not counted), MFU {report.mfu(chip):.1%}")
        if report.serial_passes:
            serial = report.serial_time(chip)
            lines.append(f"of which Hope's pass 1: {report.serial_passes} sequential passes per window, at least "
                         f"{report.serial_bytes / 1e9:.0f} GB HBM traffic per device (every weight and each "
                         f"sequence's Δ per pass): >= {serial * 1e3:.1f} ms, {serial / t:.0%} of the step")
    if report.xla_flops is not None:  # XLA compiled it (over HBM or not)
        kinds = ", ".join(f"{k} {v}" for k, v in report.collectives.items()) or "none"
        lines.append(f"collectives in the program (a loop body counted once): {kinds}")
        if report.device_arrays:
            lines.append(f"largest arrays per device: {'; '.join(report.device_arrays)}")
        lines.append(f"compiled in {report.compile_s:.1f} s")
    if report.fits is False:
        largest = f"; largest buffers: {'; '.join(report.largest)}" if report.largest else ""
        lines.append(f"does not fit: {report.error}{largest}")
    return "\n".join(lines)


def as_row(report: Report) -> dict:
    """A JSON-able record of the report, with the derived figures."""
    chip = CHIPS.get(report.topology.partition(":")[0])
    row = dataclasses.asdict(report)
    row.update(total_bytes=report.total_bytes, step_time_s=report.step_time(chip), mfu=report.mfu(chip),
               serial_time_s=report.serial_time(chip))
    return row


def shard_param_count(abstract_params) -> int:
    """Parameters one device holds (the largest shard of each array)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(abstract_params))

