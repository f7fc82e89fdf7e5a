"""nlearn-compile: the train step compiled for a TPU topology on this CPU machine (libtpu, the `tpu` extra),
and the HLO reading behind its FLOPs and collectives."""

import math
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from nlearn.errors import UserError
from nlearn.train import hlo
from run_helpers import ROOT, run_cli
from test_families import tiny

pytest.importorskip("libtpu", reason="nlearn-compile's TPU topologies need the tpu extra: pip install 'nlearn[tpu]'")

from nlearn.train.compile import CHIPS, compile_step, describe, topology_devices  # noqa: E402

SMALL = ["--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.num_heads=2",
         "--config.data.vocab_size=256"]


def test_scanned_matmuls_count_every_iteration():
    """XLA's cost_analysis counts a loop body once; the HLO count multiplies it by the trip count."""
    def f(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=7)[0]

    x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    lowered = jax.jit(f).lower(x, x)
    flops, unknown = hlo.matmul_flops(lowered.as_text(dialect="hlo"))
    assert (flops, unknown) == (7 * 2 * 64**3, 0)
    assert hlo.matmul_flops(lowered.compile().as_text())[0] == flops
    assert lowered.compile().cost_analysis()["flops"] < 2 * 2 * 64**3


@pytest.mark.parametrize("family", [pytest.param("transformer", marks=pytest.mark.slow), "titans_lmm"])
def test_tiny_compiles_for_v5e_with_fsdp(family):
    config = tiny(family, dtype="bfloat16", remat=True)
    with config.unlocked():
        config.mesh.update(data=2, fsdp=2)
        config.train.update(batch_size=4, seq_len=32)
    report = compile_step(config, "v5e:2x2")
    assert report.devices == 4 and report.mesh["data"] == 2 and report.mesh["fsdp"] == 2
    # Per-device parameter bytes: each array's size over the mesh axes its sharding splits it on, x 4 bytes.
    from nlearn.train.state import make_setup

    setup = make_setup(config, devices=topology_devices("v5e:2x2")[0])
    sharded = 0
    for x in jax.tree.leaves(setup.abstract_state["params"]):
        split = math.prod(setup.mesh.shape[a] for axes in x.sharding.spec if axes
                          for a in (axes if isinstance(axes, tuple) else (axes,)))
        sharded += x.size // split
    assert sharded < setup.n_params  # fsdp really splits something
    assert report.param_bytes == sharded * jnp.dtype(jnp.float32).itemsize
    # XLA's own argument bytes hold the state (parameters, Adam's two moments), padded to the TPU's tiles.
    assert 0 <= report.opt_bytes - 2 * report.param_bytes <= 64  # Adam's two moments and its step count
    assert report.param_bytes + report.opt_bytes <= report.argument_bytes < 4 * (report.param_bytes + report.opt_bytes)
    assert report.fits and report.total_bytes < CHIPS["v5e"].hbm_bytes
    assert report.collectives.get("all-gather", 0) > 0  # fsdp gathers the split parameters
    assert report.model_matmul_flops / report.analytic_flops == pytest.approx(1.0, abs=0.1)  # flops.py's count
    assert report.hlo_matmul_flops > 1.1 * report.model_matmul_flops  # remat recomputes the forward
    assert "estimated step time" in describe(report)
    # Every device computes its own sequence only: no [B, T, ...] activation of the whole batch (logits included).
    shapes = [a.split(" ")[0] for a in report.device_arrays]
    assert any(s.startswith("f32[1,32,") for s in shapes), report.device_arrays
    assert not any(re.match(r"\w+\[[234],32,", s) for s in shapes), report.device_arrays


def test_oversized_config_is_refused_in_one_line():
    out = run_cli("compile", "--config=configs/transformer.py:tiny", "--topology=v5e:2x2", *SMALL,
                  "--config.mesh.data=4", "--config.train.batch_size=64", "--config.train.seq_len=65536",
                  "--config.data.vocab_size=32000", timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    refusal = [line for line in lines if line.startswith("does not fit")]
    assert refusal and "largest buffers" in refusal[0], out.stdout
    # then the micro-batch search: the first guess from the temporaries is one sequence per shard (grad_accum 16),
    # which still does not fit; its compiled program is reported
    assert "train.grad_accum=16 (1 sequence per batch shard per micro-batch): does not fit" in out.stdout
    assert any(line.startswith("does not fit even at one sequence per batch shard") for line in lines), out.stdout


def test_topology_errors_are_one_line():
    with pytest.raises(UserError, match="v9z:2x2"):
        topology_devices("v9z:2x2")
    script = ("import sys; sys.modules['libtpu'] = None\n"
              "from nlearn.train.compile import topology_devices\n"
              "try:\n    topology_devices('v5e:2x2')\nexcept Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("UserError") and "nlearn[tpu]" in out.stdout, out.stdout + out.stderr


def test_the_micro_batch_search_guesses_from_the_temporaries_and_stops_at_the_first_fit(monkeypatch):
    """The search's arithmetic, with each compile's temporaries a function of the micro-batch (the real compiles
    are covered above): 64 sequences over 4 shards asking for 1.5x the chip's HBM start at grad_accum 2, which
    (temporaries grow faster than the micro-batch) still does not fit, then 4 does; a sequence too large for a
    chip ends at one sequence per shard."""
    from nlearn.train import compile as compile_lib

    config = tiny("transformer")
    with config.unlocked():
        config.mesh.update(data=4)
        config.train.update(batch_size=64)
    hbm = CHIPS["v5e"].hbm_bytes
    per_sequence = 1.5 * hbm / 16  # a 16-sequence shard asks for 1.5 HBMs
    tried = []

    def fake_compile(trial, topology):
        per_shard = trial.train.batch_size // (trial.train.grad_accum * 4)
        tried.append(trial.train.grad_accum)
        temp = per_shard * per_sequence * (1.6 if per_shard > 4 else 1.0)  # not quite linear, as XLA's
        return compile_lib.Report("transformer", topology, 4, {"data": 4, "fsdp": 1}, 64, 128, "float32", 1, 0, 0,
                                  temp <= hbm, hbm, 0.0, temp, 0.0, 0.0)

    monkeypatch.setattr(compile_lib, "compile_step", fake_compile)
    refused = compile_lib.Report("transformer", "v5e:2x2", 4, {"data": 4, "fsdp": 1}, 64, 128, "float32", 1, 0, 0,
                                 False, hbm, temp_bytes=16 * per_sequence)
    accum, report = compile_lib.fitting_grad_accum(config, "v5e:2x2", refused, log=lambda m: None)
    assert tried == [2, 4] and accum == 4 and report.fits
    too_big = compile_lib.Report("transformer", "v5e:2x2", 4, {"data": 4, "fsdp": 1}, 64, 128, "float32", 1, 0, 0,
                                 False, hbm, temp_bytes=1000 * hbm)
    tried.clear()
    per_sequence = 2 * hbm  # one sequence alone does not fit: the last report is one sequence per shard
    accum, report = compile_lib.fitting_grad_accum(config, "v5e:2x2", too_big, log=lambda m: None)
    assert tried == [16] and accum == 16 and not report.fits
