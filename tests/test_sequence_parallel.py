"""Sequence parallelism (`mesh.sequence`): the 4-device checks run in a child process
(`tests/sequence_parallel_cases.py`, 4 forced host devices); config refusals run here."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from run_helpers import ROOT, load_family_config, run_cli, tiny_overrides

CASES = os.path.join(ROOT, "tests", "sequence_parallel_cases.py")


def run_cases(marker: str):
    # Unoptimized XLA code compiles ~1.5x faster here and is exact all the same.
    flags = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true")
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, CASES],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]


def test_split_sequences_match_single_device():
    """Linear attention (values, states, grads), the conv halo, a gated_deltanet model (the gated delta
    rule's fold/scan/finish, halos, a data axis beside the split), the refusal of a nonlinear memory."""
    run_cases("not slow")


@pytest.mark.slow
def test_split_sequences_match_single_device_for_every_family():
    """The delta rule, gated delta rule and normalized linear attention ops; deltanet, linear_attention
    and transformer models on 4 devices."""
    run_cases("slow")


@pytest.mark.slow
def test_training_on_a_split_sequence_matches_one_device(tmp_path, cache_dir, text_corpus):
    """The trainer end to end (batch placement, the mesh context, eval): 4 devices splitting each
    sequence end with the 1-device eval loss."""
    losses = []
    for name, extra, env in [("one", [], {}),
                             ("split", ["--config.mesh.data=1", "--config.mesh.sequence=4"],
                              {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})]:
        proc = run_cli("train", "--config=configs/deltanet.py:tiny", f"--workdir={tmp_path / name}",
                       *tiny_overrides(cache_dir, text_corpus, **{"train.steps": 4}), *extra, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        losses.append(json.load(open(tmp_path / name / "eval.json"))["loss"])
    assert "'sequence': 4" in proc.stdout
    assert abs(losses[1] - losses[0]) <= 1e-5 * losses[0], losses


@pytest.mark.slow
def test_memory_script_shows_the_split_step_smaller_and_its_collectives():
    proc = subprocess.run([sys.executable, "benchmarks/seqpar_memory.py", "--tokens=512", "--devices=4", "--run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    peaks = [float(m) for m in re.findall(r"^\| (?:1 device|4 devices)[^|]*\|[^|]*\|[^|]*\| ([0-9.]+)", proc.stdout,
                                          re.M)]
    assert len(peaks) == 2 and peaks[1] < peaks[0], proc.stdout
    permutes = int(re.search(r"\| collective-permute\s*\| (\d+)", proc.stdout).group(1))
    assert permutes > 0 and "loss" in proc.stdout, proc.stdout


@pytest.mark.parametrize("family,overrides,message", [
    ("titans_lmm", {"sequence": 4}, "mesh.sequence=4: family titans_lmm cannot split a sequence"),
    ("deltanet", {"sequence": 0}, "mesh.sequence=0: must be a positive size"),
    ("deltanet", {"sequence": 3}, "mesh.sequence=3: must divide train.seq_len=256"),
])
def test_config_refuses_bad_sequence_axis(family, overrides, message):
    from nlearn.config import validate
    from nlearn.errors import UserError

    config = load_family_config(family)
    config.mesh.update(overrides)
    with pytest.raises(UserError, match=message) as err:
        validate(config)
    assert "\n" not in str(err.value)


def test_mesh_splits_the_batch_time_axis_only_when_asked():
    import jax

    from nlearn.train import mesh as mesh_lib

    config = load_family_config("deltanet")
    mesh = mesh_lib.make_mesh(config)
    assert dict(mesh.shape) == {"data": jax.device_count(), "fsdp": 1, "tensor": 1, "sequence": 1}
    rules = mesh_lib.rules_table(config)
    assert mesh_lib.batch_sharding(mesh, rules).spec[1] is None
    step = object()
    assert mesh_lib.in_mesh_context(step, mesh) is step  # no sequence split: the step is unchanged
