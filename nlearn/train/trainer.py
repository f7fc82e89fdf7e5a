"""`train_and_evaluate(config, workdir)`: the whole run, resumable at any checkpoint.

Restarting the same command resumes from the newest readable checkpoint (params, optimizer,
step, RNG, data position, wandb run id), so a killed run loses at most the steps since it.
SIGTERM / Ctrl-C save a checkpoint at the current step and exit cleanly.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time

import jax
from absl import logging

from nlearn import config as config_lib
from nlearn import data
from nlearn.errors import UserError
from nlearn.eval.fast_weights import make_fast_weight_norm
from nlearn.eval.perplexity import make_evaluator
from nlearn.train import distributed
from nlearn.train import flops as flops_lib
from nlearn.train import state_passing
from nlearn.train.checkpoint import Checkpointer
from nlearn.train.hooks import make_hook
from nlearn.train.metrics import MetricsWriter, Progress, Wandb, plot_losses
from nlearn.train.state import make_setup


def sharding_summary(params) -> str:
    """How many parameter arrays are split across devices (vs replicated)."""
    leaves = jax.tree.leaves(params)
    split = [x for x in leaves if not x.sharding.is_fully_replicated]
    size = sum(x.size for x in split)
    return (f"{len(split)} of {len(leaves)} parameter arrays split over the mesh "
            f"({size / max(sum(x.size for x in leaves), 1):.0%} of parameters)")


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps, saves and exits.

    With several processes all must stop after the same step: SIGTERM is left to JAX's preemption
    notifier, SIGINT is turned into a SIGTERM to this process, and `at(step)` asks the preemption sync
    point (every process gets True at the same step once any of them was signalled)."""

    def __init__(self, processes: int = 1):
        self.signal = None
        self._old = {}
        self.processes = processes

    def at(self, step: int) -> str | None:
        if self.processes == 1:
            return self.signal
        from jax.experimental import multihost_utils
        return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT) if self.processes == 1 else (signal.SIGINT,):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.processes > 1:
            os.kill(os.getpid(), signal.SIGTERM)
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def open_data(config, setup):
    """This process's training iterator and evaluation batches: the rows of each global batch its devices
    hold (the tokenizer must fit the model)."""
    index, count = distributed.batch_rows(setup.batch_sharding, config.train.batch_size, config.train.seq_len)
    train_iter = data.make_train_iterator(config, process_index=index, process_count=count)
    eval_batches = data.make_eval_batches(config, process_index=index, process_count=count)
    if data.vocab_size(config) != config.model.vocab_size:
        raise UserError(f"the tokenizer has {data.vocab_size(config)} pieces but model.vocab_size is "
                        f"{config.model.vocab_size}; set --config.data.vocab_size={data.vocab_size(config)}")
    return train_iter, eval_batches


def restore_or_init(ckpt, setup, train_iter, workdir: str, lead: bool):
    """`(step, state, meta)` of the newest readable checkpoint (`train_iter` moved to its position),
    or a fresh state at step 0 with no meta."""
    if not ckpt.steps():
        return 0, setup.init_state(), None
    step, state, meta = ckpt.restore(setup.abstract_state, train_iter)
    logging.info("resumed from step %d in %s", step, workdir)
    if lead:
        print(f"resuming from checkpoint at step {step}", flush=True)
    if "carry" in setup.abstract_state and "carry" not in state:
        state["carry"] = setup.fresh_carry(state["params"])
        if lead:
            print("the checkpoint carries no recurrent states (trained without train.state_passing): every row "
                  "starts fresh at the first step", flush=True)
    return int(step), state, meta


def finite_metrics(metrics, step: int, ckpt) -> dict:
    """The step's metrics as floats; a non-finite loss or gradient stops the run before it can reach a
    checkpoint."""
    record = {k: float(v) for k, v in jax.device_get(metrics).items()}
    for name in ("loss", "grad_norm"):
        if not math.isfinite(record[name]):
            ckpt.wait()
            raise UserError(f"training {name.replace('_', ' ')} became {record[name]} at step {step}; "
                            f"checkpoints up to step {max(ckpt.steps(), default=0)} are intact "
                            "(lower train.lr or the memory's max_lr and resume)")
    return record


def train_and_evaluate(config, workdir: str) -> dict:
    """Train `config` in `workdir` (resuming from its newest readable checkpoint); the final eval metrics."""
    config = config_lib.migrate(config)
    config_lib.validate(config)
    data.vocab_size(config)  # a tokenizer to train is trained before the peers' watchdog starts
    processes = distributed.initialize(config)
    if processes and config.train.time_budget_s:
        raise UserError("train.time_budget_s needs a single process (each process would time its own steps "
                        "and plan a different total)")
    os.makedirs(workdir, exist_ok=True)
    lead = jax.process_index() == 0
    if lead:
        config_lib.save_config(config, workdir)

    t = config.train
    setup = make_setup(config)
    train_iter, eval_batches = open_data(config, setup)
    hook = make_hook(config, workdir, lead)
    evaluate = make_evaluator(setup, hook.compiler_options)
    fast_weights = make_fast_weight_norm(setup) if config.logging.fast_weights else None
    ckpt = Checkpointer(workdir, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    step, state, restored = restore_or_init(ckpt, setup, train_iter, workdir, lead)
    total = hook.plan(restored)  # the run's last step (a hook may change it, e.g. a time budget)

    tokens_per_step = t.batch_size * t.seq_len
    peak = t.peak_gflops or flops_lib.measure_matmul_gflops()
    progress = Progress(total, step, tokens_per_step,
                        flops_lib.flops_per_token(config.model, setup.abstract_state["params"], t.seq_len),
                        flops_lib.run_peak_flops(peak), enabled=lead and config.logging.progress)
    writer = MetricsWriter(workdir, step) if lead else None
    run_id = (restored or {}).get("wandb_run_id")
    wandb = Wandb(config, workdir, run_id) if lead else None
    meta = {"config": config.to_dict(), "wandb_run_id": wandb.run_id if wandb else run_id}
    if lead:
        print(f"{config.model.family}: {setup.n_params / 1e6:.2f}M parameters, mesh {dict(setup.mesh.shape)}, "
              f"{tokens_per_step} tokens/step, steps {step}->{total}\nsharding: {sharding_summary(state['params'])}",
              flush=True)
    train_step = hook.jit_step(setup)

    def log(record):
        if lead:
            writer.write(record)
            wandb.log(record, record["step"])

    def run_eval(step):
        result = evaluate(state["params"], eval_batches)
        if fast_weights is not None:  # the memories' largest fast weight over the first eval sequences
            result["fast_weight_norm"] = fast_weights(state["params"], next(iter(eval_batches))["inputs"])
        log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        if lead and config.logging.progress:
            print(f"eval at step {step}: {describe_eval(result)}", flush=True)
        return result

    start_time, stopped, compiling, warned_blocked = time.perf_counter(), None, True, False
    with _StopFlag(jax.process_count() if processes else 1) as stop:
        while step < total:
            began = time.perf_counter()
            batch = next(train_iter)
            state, metrics = train_step(state, setup.put_batch(batch))
            step += 1
            if compiling:  # compilation stays out of the first throughput figure
                jax.block_until_ready(metrics)
                progress.reset_clock(step)
                compiling = False
            if (planned := hook.after_step(step, batch, metrics, began)) is not None:
                total = progress.total = planned
            stopped = stop.at(step)  # read once: a signal arriving later waits for the next step
            saving = step % config.checkpoint.every_steps == 0 or step == total or stopped
            if step % t.log_every == 0 or saving:
                record = finite_metrics(metrics, step, ckpt)
                if lead and record.get("passing_blocked") and not warned_blocked:
                    print(state_passing.BLOCKED_WARNING.format(step=step, family=config.model.family), flush=True)
                    warned_blocked = True
                if step % t.log_every == 0 or step == total:
                    log({**progress.update(step, record), "step": step})
            if t.eval_every and step % t.eval_every == 0 and step != total:
                eval_began = time.perf_counter()
                run_eval(step)
                hook.after_eval(time.perf_counter() - eval_began)
                progress.reset_clock(step)
            if saving:
                ckpt.save(step, state, train_iter, {**meta, **hook.meta()}, force=bool(stopped))
            if stopped:
                break
    ckpt.wait()
    if stopped or not t.final_eval:
        ckpt.close()
        return ended_early(step, stopped, workdir, lead, time.perf_counter() - start_time)
    result = {**run_eval(step), "step": step, "train_seconds": time.perf_counter() - start_time}
    ckpt.close()
    if lead:
        save_final(result, workdir, config, wandb)
    return result


def ended_early(step: int, stopped: str | None, workdir: str, lead: bool, seconds: float) -> dict:
    """The result of a run stopped by a signal, or trained without its final evaluation."""
    if lead:
        print(f"received {stopped}: saved a checkpoint at step {step}; rerun the same command to resume"
              if stopped else f"trained to step {step}; score it with nlearn-eval --workdir={workdir}", flush=True)
    return {"step": step, "stopped": stopped} if stopped else {"step": step, "train_seconds": seconds}


def save_final(result: dict, workdir: str, config, wandb) -> None:
    """`eval.json`, the loss plot (`logging.plot`), and the end of the wandb run."""
    with open(os.path.join(workdir, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    if config.logging.plot:
        plot_losses(workdir)
    wandb.finish()


def describe_eval(result: dict) -> str:
    """'loss L, perplexity P' plus any task metric the evaluation reports (e.g. MQAR's recall)."""
    extra = "".join(f", {k.replace('_', ' ')} {v:.4f}" for k, v in result.items()
                    if k not in ("loss", "perplexity", "accuracy", "tokens"))
    return f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f}{extra}"
