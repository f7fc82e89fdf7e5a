"""Helpers shared by the end-to-end tests: small overrides, a subprocess runner for the CLIs and a
loader for the family config files."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Families whose shared per-family tests (causality, decoding, step types) compile for a minute or more on
# 2 cores (Hope's two-pass CMS step, the self-referential op): they run under `make test-all`; their own
# test files keep a fast causality / decoding check in the default suite.
SLOW_FAMILIES = ("hope", "self_ref_titans", "titans_mac")  # titans_mac: tests/test_titans.py covers it by default


def family_params(families, also_slow=()) -> list:
    """`families` as pytest parameters, the SLOW_FAMILIES (and `also_slow`) marked slow."""
    import pytest

    slow = set(SLOW_FAMILIES) | set(also_slow)
    return [pytest.param(f, marks=pytest.mark.slow) if f in slow else f for f in families]


def tiny_overrides(cache_dir: str, text_glob: str, **extra) -> list[str]:
    """CLI overrides for a seconds-long run on the small text corpus."""
    values = {
        "data.source": "text", "data.path": text_glob, "data.cache_dir": cache_dir,
        "data.vocab_size": 300, "data.eval_tokens": 2048,
        "model.d_model": 32, "model.num_layers": 2, "model.num_heads": 2,
        "train.steps": 6, "train.batch_size": 8, "train.seq_len": 32, "train.warmup_steps": 2,
        "train.log_every": 2, "train.peak_gflops": 100.0, "checkpoint.every_steps": 3,
        "logging.wandb_mode": "disabled", "logging.plot": False,
    }
    values.update(extra)
    return [f"--config.{k}={v}" for k, v in values.items()]


def run_cli(module: str, *args: str, env: dict | None = None, timeout: int = 300):
    """Run `python -m nlearn.cli.<module> args` and return the CompletedProcess."""
    full_env = dict(os.environ, **(env or {}))
    full_env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run([sys.executable, "-m", f"nlearn.cli.{module}", *args], cwd=ROOT,
                          capture_output=True, text=True, env=full_env, timeout=timeout)


def load_family_config(family: str, preset: str = "tiny", folder: str = "configs"):
    """`<folder>/<family>.py:<preset>` (configs/ is not a package, so loaded by path); folder
    "benchmarks/configs" for the task presets (`load_family_config("niah", "deltanet", "benchmarks/configs")`)."""
    path = os.path.join(ROOT, folder, f"{family}.py")
    spec = importlib.util.spec_from_file_location(f"nlearn_config_test_{folder.replace('/', '_')}_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(preset)


def kill_after_checkpoint_and_resume(workdir, cmd: list[str], step: int, timeout: int = 600):
    """Run `cmd` in ROOT, SIGKILL it right after its step-`step` checkpoint appears in `workdir`, rerun it;
    the rerun's CompletedProcess (checked to have resumed)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while not os.path.isdir(os.path.join(workdir, "checkpoints", str(step))) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not os.path.exists(os.path.join(workdir, "eval.json"))  # really interrupted
    resumed = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert "resuming from checkpoint at step" in resumed.stdout, resumed.stdout + resumed.stderr
    return resumed
