"""Several processes on localhost (scripts/launch_local.py): the same losses as one process, checkpoints
that move between process counts, and no hang when a peer dies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from run_helpers import ROOT, run_cli, tiny_overrides

LAUNCH = os.path.join(ROOT, "scripts", "launch_local.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def launch(args, processes=2, devices=2, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, LAUNCH, f"--processes={processes}", f"--devices_per_process={devices}",
                           "--", *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def one_process(args, devices):
    return run_cli("train", *args, env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
                   timeout=900)


def eval_loss(workdir, proc) -> float:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.load(open(os.path.join(workdir, "eval.json")))
    assert result["step"] == 6
    return result["loss"]


def resumable_copy(workdir, to) -> str:
    """`workdir` as it was after its step-3 checkpoint (the later checkpoint and the result removed)."""
    shutil.copytree(workdir, to)
    shutil.rmtree(os.path.join(to, "checkpoints", "6"))
    os.remove(os.path.join(to, "eval.json"))
    return str(to)


def rel(a, b) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("key,value", [("coordinator", "localhost"), ("num_processes", -1), ("process_id", 2),
                                       ("timeout_s", -5)])
def test_bad_distributed_settings_are_refused(key, value):
    from nlearn.config import validate
    from nlearn.errors import UserError
    from run_helpers import load_family_config

    config = load_family_config("transformer")
    config.distributed.num_processes = 2
    config.distributed[key] = value
    with pytest.raises(UserError, match=f"distributed.{key}="):
        validate(config)


def test_one_process_leaves_jax_distributed_alone(monkeypatch):
    from nlearn.errors import UserError
    from nlearn.train import distributed
    from run_helpers import load_family_config

    for var in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri",
                "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(var, raising=False)
    config = load_family_config("transformer")
    assert not distributed.wanted(config)
    config.distributed.num_processes = 2
    assert distributed.wanted(config)
    # A coordinator named in the environment but no process count: one line saying what is missing.
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    config.distributed.num_processes = 0
    with pytest.raises(UserError, match="jax.distributed.initialize failed .*coordinator=localhost:1"):
        distributed.initialize(config)


PEER = textwrap.dedent("""
    import os, sys, time
    import ml_collections
    from nlearn.train import distributed
    me = int(sys.argv[2])
    config = ml_collections.ConfigDict({"distributed": {"coordinator": sys.argv[1], "num_processes": 3,
                                                        "process_id": me, "timeout_s": 2}})
    assert distributed.initialize(config)
    print(b"|".join(distributed.exchange("hello", str(me).encode())).decode(), flush=True)
    if me == 1:
        time.sleep(3)
        os._exit(0)  # dies without leaving the job
    if me == 2:
        distributed.finish()  # done: waits for the others in JAX's shutdown barrier, no longer heartbeating
    time.sleep(60)
""")


@pytest.mark.slow
def test_peers_exchange_and_a_dead_one_is_named():
    """Three bare processes: `exchange` returns every process's payload. Process 2 finishes at once, process 1
    vanishes 3 s later: process 0 stops within timeout_s (2 s) of the death with one line naming process 1
    (a finished peer is not a lost one), rather than waiting in a collective for ever."""
    from launch_local import free_port, process_env

    address = f"localhost:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", PEER, address, str(i)], cwd=ROOT, env=process_env(1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    out1, _ = procs[1].communicate(timeout=120)
    began = time.monotonic()
    out0, err0 = procs[0].communicate(timeout=120)
    waited = time.monotonic() - began
    procs[2].kill()
    procs[2].wait()
    assert out0.strip() == out1.strip() == "0|1|2"
    assert procs[0].returncode == 3 and waited < 30, (procs[0].returncode, waited, err0)
    assert [line for line in err0.splitlines() if line.startswith("error:")] == [
        next(line for line in err0.splitlines() if "lost process 1 of 3: no heartbeat" in line)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["transformer", "titans_lmm"])
def test_two_processes_train_as_one(tmp_path, cache_dir, text_corpus, family):
    """2 processes x 2 devices give the eval loss of 1 process x 4 devices; logs come from process 0 only."""
    args = [f"--config=configs/{family}.py:tiny", *tiny_overrides(cache_dir, text_corpus)]
    two = launch([*args, f"--workdir={tmp_path / 'two'}"])
    one = one_process([*args, f"--workdir={tmp_path / 'one'}"], devices=4)
    assert rel(eval_loss(tmp_path / "two", two), eval_loss(tmp_path / "one", one)) <= 1e-5
    assert "[p0] final: step 6" in two.stdout and "[p1] final" not in two.stdout
    assert "'data': 4" in two.stdout and not [l for l in two.stdout.splitlines() if l.startswith("[p1] step")]


@pytest.mark.slow
def test_checkpoints_move_between_process_counts(tmp_path, cache_dir, text_corpus):
    """A 2-process checkpoint resumes in 1 process with 4 devices and a 1-process one in 2 processes,
    each ending where the uninterrupted runs end (same step, same eval loss)."""
    args = ["--config=configs/transformer.py:tiny", *tiny_overrides(cache_dir, text_corpus)]
    two = launch([*args, f"--workdir={tmp_path / 'two'}"])
    one = one_process([*args, f"--workdir={tmp_path / 'one'}"], devices=4)
    reference = eval_loss(tmp_path / "one", one)
    assert rel(eval_loss(tmp_path / "two", two), reference) <= 1e-5
    to_one = resumable_copy(tmp_path / "two", tmp_path / "two_then_one")
    to_two = resumable_copy(tmp_path / "one", tmp_path / "one_then_two")
    resumed = {"one": one_process([*args, f"--workdir={to_one}"], devices=4),
               "two": launch([*args, f"--workdir={to_two}"])}
    for name, workdir in (("one", to_one), ("two", to_two)):
        assert "resuming from checkpoint at step 3" in resumed[name].stdout
        assert rel(eval_loss(workdir, resumed[name]), reference) <= 1e-5


@pytest.mark.slow
def test_eight_device_checkpoint_resumes_on_one_and_on_four(tmp_path, cache_dir, text_corpus):
    """One process, another topology: written on 8 devices as data 2 x fsdp 2 x tensor 2, resumed on 1 and
    on 4 devices; the run ends at the same step with its eval loss (up to float reassociation)."""
    args = ["--config=configs/transformer.py:tiny", *tiny_overrides(cache_dir, text_corpus)]
    mesh = ["--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2"]
    eight = one_process([*args, *mesh, f"--workdir={tmp_path / 'eight'}"], devices=8)
    reference = eval_loss(tmp_path / "eight", eight)
    for devices in (1, 4):
        workdir = resumable_copy(tmp_path / "eight", tmp_path / f"to_{devices}")
        proc = one_process([*args, f"--workdir={workdir}"], devices=devices)
        assert "resuming from checkpoint at step 3" in proc.stdout
        assert rel(eval_loss(workdir, proc), reference) <= 1e-4


@pytest.mark.slow
def test_a_killed_process_stops_the_others(tmp_path, cache_dir, text_corpus):
    """With the default distributed.timeout_s, killing process 1 mid-training makes process 0 exit non-zero
    within 120 s with one line naming it; killing process 0 (the coordinator) ends process 1 at once, and
    under launch_local the launcher names the dead process and stops the rest."""
    from launch_local import command, free_port, process_env

    args = ["--config=configs/transformer.py:tiny", *tiny_overrides(cache_dir, text_corpus),
            "--config.train.steps=100000", "--config.checkpoint.every_steps=100000"]

    def start(workdir):
        port = free_port()
        procs = [subprocess.Popen(command([*args, f"--workdir={workdir}"], i, 2, port, "nlearn.cli.train"),
                                  cwd=ROOT, env=process_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for i in range(2)]
        for line in procs[0].stdout:  # training has started on both
            if line.startswith("step"):
                return procs
        raise AssertionError(procs[0].communicate()[1][-3000:])

    for victim in (1, 0):
        procs = start(tmp_path / f"kill{victim}")
        procs[victim].kill()
        began = time.monotonic()
        _, err = procs[1 - victim].communicate(timeout=300)
        waited = time.monotonic() - began
        procs[victim].wait()
        assert procs[1 - victim].returncode != 0 and waited <= 120, (waited, err[-3000:])
        if victim == 1:
            assert [line for line in err.splitlines() if line.startswith("error:")] == [
                next(line for line in err.splitlines() if "lost process 1 of 2: no heartbeat for" in line)]
        else:  # JAX's own error polling is quicker than the watchdog here: it names the leader task
            assert "leader task was preempted/died" in err, err[-3000:]


@pytest.mark.slow
def test_ctrl_c_stops_every_process_at_one_step_with_a_checkpoint(tmp_path, cache_dir, text_corpus):
    """Ctrl-C to launch_local: every process gets SIGTERM, they agree on a step (JAX's preemption sync
    point), save one checkpoint there and exit 0; the same command then resumes from it."""
    import signal

    args = ["--config=configs/transformer.py:tiny", *tiny_overrides(cache_dir, text_corpus),
            "--config.train.steps=100000", "--config.checkpoint.every_steps=100000", f"--workdir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, LAUNCH, "--processes=2", "--devices_per_process=2", "--", *args],
                            cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[p0] step"):
            break
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    saved = next(line for line in out.splitlines() if "received SIGTERM: saved a checkpoint at step" in line)
    step = int(saved.split("at step ")[1].split(";")[0])
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == [step]
    resumed = launch([*args[:-3], "--config.train.steps=" + str(step + 2), f"--workdir={tmp_path}"])
    assert resumed.returncode == 0 and f"[p0] resuming from checkpoint at step {step}" in resumed.stdout


FAKE_WORKER = textwrap.dedent("""
    import signal, sys, time
    index = int(next(a for a in sys.argv if "distributed.process_id=" in a).split("=")[1])
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
    print("ready", flush=True)  # after the handler: the test signals as soon as it reads this
    if sys.argv[1] == "fail" and index == 1:
        sys.exit(5)
    time.sleep(120)
""")


@pytest.mark.parametrize("mode", ["fail", "interrupt"])
def test_launcher_stops_everyone_on_a_failure_and_forwards_signals(tmp_path, mode):
    """launch_local: a failing process takes the others down (its exit code, one line naming it); SIGINT
    reaches every process as SIGTERM. Stand-in workers keep it cheap."""
    import signal

    (tmp_path / "fake_worker.py").write_text(FAKE_WORKER)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, LAUNCH, "--processes=2", "--module=fake_worker", "--", mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    if mode == "interrupt":
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert sorted(lines) == ["[p0] ready\n", "[p1] ready\n"]
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    if mode == "fail":
        assert proc.returncode == 5 and "launch_local: process 1 exited with code 5; killing the others" in out
    else:
        assert proc.returncode == 0 and "[p0] got SIGTERM" in out and "[p1] got SIGTERM" in out, out
