"""Several processes: `jax.distributed` set up from the config or the cluster's environment, a watchdog
that stops every survivor with one line when a peer dies, and small cross-process exchanges.

Nothing here runs for a single process: `initialize` returns without touching jax.distributed when no
coordinator is configured and no cluster (SLURM, Cloud TPU, Open MPI, ...) is detected.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from nlearn.errors import UserError

EXIT_LOST_PEER = 3
_KEY = "nlearn"
_watchdog = None
DONE = "done"


def _setting(config, name: str, default):
    section = config.get("distributed") if hasattr(config, "get") else None
    return default if section is None else section.get(name, default)


def _cluster_detected() -> bool:
    """Whether JAX's own auto-detection (SLURM, Cloud TPU, GKE, Open MPI, ...) sees a multi-process job."""
    if os.environ.get("SLURM_NTASKS") == "1" or os.environ.get("SLURM_STEP_NUM_TASKS") == "1":
        return False  # one task: nothing to coordinate
    try:
        from jax._src.clusters import ClusterEnv
        return any(env.is_env_present() for env in ClusterEnv._cluster_types if not env.opt_in_only_method)
    except Exception:  # a jax without the (private) registry: the documented variables only
        return any(os.environ.get(v) for v in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "TPU_WORKER_HOSTNAMES"))


def wanted(config) -> bool:
    """Whether this process is one of several: configured, named by JAX_COORDINATOR_ADDRESS, or detected."""
    return bool(_setting(config, "coordinator", "") or _setting(config, "num_processes", 0) > 1
                or os.environ.get("JAX_COORDINATOR_ADDRESS") or _cluster_detected())


def initialize(config) -> bool:
    """`jax.distributed.initialize` with the config's `distributed.*` settings (unset ones from the
    environment, as JAX detects them), then the peer watchdog; call before any device is used.
    Returns whether this run has several processes."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    if not wanted(config):
        return False
    timeout_s = int(_setting(config, "timeout_s", 60))
    num = int(_setting(config, "num_processes", 0)) or None
    pid = int(_setting(config, "process_id", -1))
    coordinator = _setting(config, "coordinator", "") or None
    named = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "unset"
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator, num_processes=num, process_id=None if pid < 0 else pid,
            initialization_timeout=max(timeout_s, 300),
            # JAX's own check aborts with a stack trace: ours (below) must speak first.
            heartbeat_timeout_seconds=2 * timeout_s + 30 if timeout_s else 100)
    except Exception as e:  # missing settings, an unreachable coordinator: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"jax.distributed.initialize failed ({first}); with coordinator={named}, "
                        f"num_processes={num or 'unset'}, process_id={pid if pid >= 0 else 'unset'} "
                        "(set distributed.coordinator/num_processes/process_id, or run under SLURM or on a TPU "
                        "pod)") from e
    if jax.process_count() > 1 and timeout_s:
        global _watchdog
        _watchdog = Watchdog(timeout_s)
        _watchdog.start()
    return jax.process_count() > 1


def finish() -> None:
    """Leave the job together: stop the watchdog, then JAX's shutdown barrier (a process that left early
    would take the coordinator, or the others' heartbeats, with it)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stopped.set()
        _watchdog.join()
        _client().key_value_set(f"{_KEY}/alive/{jax.process_index()}", DONE, allow_overwrite=True)
        _watchdog = None
    if jax.distributed.is_initialized():
        jax.distributed.shutdown()


def validate(config) -> None:
    """Refuse bad `distributed.*` values with one line naming the key."""
    if config.get("distributed") is None:
        return
    d = config.distributed
    if d.coordinator and (":" not in d.coordinator or not d.coordinator.rsplit(":", 1)[1].isdigit()):
        raise UserError(f"invalid config value distributed.coordinator={d.coordinator!r}: expected HOST:PORT")
    if d.num_processes < 0:
        raise UserError(f"invalid config value distributed.num_processes={d.num_processes}: must be >= 0 "
                        "(0: from the environment)")
    if d.process_id < -1 or (d.num_processes and d.process_id >= d.num_processes):
        raise UserError(f"invalid config value distributed.process_id={d.process_id}: must be -1 (from the "
                        f"environment) or in [0, distributed.num_processes={d.num_processes})")
    if d.timeout_s < 0:
        raise UserError(f"invalid config value distributed.timeout_s={d.timeout_s}: must be >= 0 (0: no watchdog)")


def _client():
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client


def lost_peer(message: str) -> None:
    """Print one line and end this process at once (a collective with a dead peer never returns)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_PEER)


class Watchdog(threading.Thread):
    """Each process bumps a counter in the coordinator's key-value store every few seconds and reads
    everyone's; a peer whose counter stands still for `timeout_s`, or a coordinator that stops answering,
    ends this process with one line naming it (instead of a collective or barrier that waits for ever)."""

    def __init__(self, timeout_s: float):
        super().__init__(name="nlearn-peer-watchdog", daemon=True)
        self.timeout_s = timeout_s
        self.period_s = max(0.2, min(5.0, timeout_s / 6))
        self.client = _client()
        self.me, self.count = jax.process_index(), jax.process_count()
        self.stopped = threading.Event()

    def run(self) -> None:
        beat, seen = 0, {}
        while not self.stopped.is_set():
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{_KEY}/alive/{self.me}", str(beat), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(f"{_KEY}/alive/"))
            except Exception as e:  # the store lives in process 0
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                lost_peer(f"lost process 0 of {self.count} (the coordinator): {first}")
            for peer in range(self.count):
                value = values.get(f"{_KEY}/alive/{peer}")
                if peer == self.me or value == DONE:  # a peer that finished waits in JAX's shutdown barrier
                    continue
                if peer not in seen or seen[peer][0] != value:
                    seen[peer] = (value, now)
                elif now - seen[peer][1] > self.timeout_s:
                    lost_peer(f"lost process {peer} of {self.count}: no heartbeat for {now - seen[peer][1]:.0f} s "
                              "(it died or hangs; see its log)")
            self.stopped.wait(self.period_s)


def exchange(name: str, payload: bytes, timeout_s: float = 300.0) -> list[bytes]:
    """Every process's `payload` for `name`, in process order (a barrier with a timeout)."""
    if jax.process_count() == 1:
        return [payload]
    client, me = _client(), jax.process_index()
    client.key_value_set_bytes(f"{_KEY}/x/{name}/{me}", payload, allow_overwrite=True)
    try:
        return [client.blocking_key_value_get_bytes(f"{_KEY}/x/{name}/{p}", int(timeout_s * 1000))
                for p in range(jax.process_count())]
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        lost_peer(f"a peer did not reach '{name}' within {timeout_s:.0f} s: {first}")


def batch_rows(sharding, batch_size: int, seq_len: int) -> tuple[int, int]:
    """`(index, count)`: this process loads rows `[index * B / count, (index + 1) * B / count)` of every
    global batch, the rows its devices hold under `sharding` (count 1: the batch is not split over
    processes, every process loads all of it)."""
    rows = set()
    for device, index in sharding.devices_indices_map((batch_size, seq_len)).items():
        if device.process_index == jax.process_index():
            rows.update(range(*index[0].indices(batch_size)))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo or batch_size % (hi - lo) or lo % (hi - lo):
        raise UserError(f"the mesh gives process {jax.process_index()} batch rows that are not one block of "
                        f"train.batch_size={batch_size}; order mesh.* so each process's devices are adjacent")
    return lo // (hi - lo), batch_size // (hi - lo)
