"""Run nlearn-train as several processes on this machine, each with its own forced CPU devices, as a pod
would run it (one process per host): for trying a multi-host config on a laptop.

    python scripts/launch_local.py --processes=2 --devices_per_process=2 -- \\
        --config=configs/transformer.py:tiny --workdir=/tmp/run

Each process gets `--config.distributed.*` (coordinator on a free localhost port, its id) and
`--xla_force_host_platform_device_count`; its output lines come prefixed with `[pN]`. If one process
fails, the others are killed and the launcher exits with its code; SIGINT/SIGTERM reach every process as
SIGTERM (they save a checkpoint at the same step and exit), a second one kills them.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 60.0  # after a forwarded stop signal, how long the processes get to save before being killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def process_env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def command(train_args: list[str], index: int, processes: int, port: int, module: str) -> list[str]:
    return [sys.executable, "-m", module, *train_args, f"--config.distributed.coordinator=localhost:{port}",
            f"--config.distributed.num_processes={processes}", f"--config.distributed.process_id={index}"]


def relay(index: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[p{index}] {line}")
        out.flush()


def launch(train_args: list[str], processes: int, devices: int, module: str = "nlearn.cli.train") -> int:
    """Start the processes and wait: 0 when all succeed, else the first failure's exit code."""
    port = free_port()
    procs = [subprocess.Popen(command(train_args, i, processes, port, module), env=process_env(devices),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for i in range(processes)]
    relays = [threading.Thread(target=relay, args=(i, p.stdout, sys.stdout), daemon=True) for i, p in enumerate(procs)]
    for t in relays:
        t.start()
    stop = {"at": None}

    def forward(signum, frame):
        if stop["at"] is None:
            stop["at"] = time.monotonic()
            print(f"launch_local: {signal.Signals(signum).name}: stopping every process (again to kill)", flush=True)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        else:
            kill(procs)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    code = 0
    while [p.poll() for p in procs].count(None):
        failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed and not code:
            index, code = failed[0]
            print(f"launch_local: process {index} exited with code {code}; killing the others", flush=True)
            kill(procs)
        if stop["at"] is not None and time.monotonic() - stop["at"] > GRACE_S:
            kill(procs)
        time.sleep(0.1)
    for t in relays:
        t.join(timeout=5)
    failed = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    if failed and not code:
        index, code = failed[0]
        print(f"launch_local: process {index} exited with code {code}", flush=True)
    return code if code >= 0 else 128 - code  # killed by a signal: the shell's convention


def kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: launch_local.py --processes=N --devices_per_process=D -- <nlearn-train args>", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=1)
    parser.add_argument("--module", default="nlearn.cli.train", help="python -m entry point to run")
    args = parser.parse_args(argv[:split])
    for name in ("processes", "devices_per_process"):
        if getattr(args, name) < 1:
            print(f"error: --{name}={getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    return launch(argv[split + 1:], args.processes, args.devices_per_process, args.module)


if __name__ == "__main__":
    sys.exit(main())
