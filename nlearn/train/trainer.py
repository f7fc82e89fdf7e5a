"""`train_and_evaluate(config, workdir)`: the whole run, resumable at any checkpoint.

Restarting the same command resumes from the newest readable checkpoint (params, optimizer,
step, RNG, data position, wandb run id), so a killed run loses at most the steps since it.
SIGTERM / Ctrl-C save a checkpoint at the current step and exit cleanly.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from nlearn import config as config_lib
from nlearn import data
from nlearn.errors import UserError
from nlearn.eval.perplexity import make_evaluator
from nlearn.train import flops as flops_lib
from nlearn.train import mesh as mesh_lib
from nlearn.train.budget import BudgetPlanner
from nlearn.train.checkpoint import Checkpointer
from nlearn.train.metrics import MetricsWriter, Progress, Wandb, plot_losses
from nlearn.train.optim import make_optimizer, wsd_total
from nlearn.train.state import make_setup
from nlearn.train.step import compiler_options, make_train_step


def maybe_initialize_distributed() -> None:
    """`jax.distributed.initialize()` when launched as one of several processes."""
    markers = ("JAX_COORDINATOR_ADDRESS", "NLEARN_DISTRIBUTED", "SLURM_NTASKS", "TPU_WORKER_HOSTNAMES")
    if jax.distributed.is_initialized() if hasattr(jax.distributed, "is_initialized") else False:
        return
    if any(os.environ.get(m) for m in markers) and os.environ.get("SLURM_NTASKS", "2") != "1":
        jax.distributed.initialize()


def sharding_summary(params) -> str:
    """How many parameter arrays are split across devices (vs replicated)."""
    leaves = jax.tree.leaves(params)
    split = [x for x in leaves if not x.sharding.is_fully_replicated]
    size = sum(x.size for x in split)
    return (f"{len(split)} of {len(leaves)} parameter arrays split over the mesh "
            f"({size / max(sum(x.size for x in leaves), 1):.0%} of parameters)")


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop checks it between steps, saves and exits."""

    def __init__(self):
        self.signal = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def make_jitted_step(setup, *, budgeted: bool):
    """The jitted `(state, batch, total) -> (state, metrics)`. A time-budgeted run passes its total
    as traced scalars into the WSD schedule, so choosing it mid-run compiles nothing again;
    otherwise the schedule is built for `train.steps` and `total` is unused."""
    t = setup.config.train
    jit = functools.partial(jax.jit, out_shardings=(setup.state_shardings, None), donate_argnums=0,
                            compiler_options=compiler_options(t))
    if budgeted:
        def step_with_total(state, batch, total):
            optimizer = make_optimizer(setup.config, total)
            return make_train_step(setup.graphdef, optimizer, grad_accum=t.grad_accum, dtype=setup.dtype)(state, batch)

        replicated = mesh_lib.replicated(setup.mesh)
        jitted = jit(step_with_total, in_shardings=(setup.state_shardings, setup.batch_sharding, replicated))
        boundaries = functools.lru_cache(maxsize=4)(lambda total: jnp.asarray(wsd_total(setup.config, total)))
        return lambda state, batch, total: jitted(state, batch, boundaries(total))  # one transfer per total
    jitted = jit(make_train_step(setup.graphdef, setup.optimizer, grad_accum=t.grad_accum, dtype=setup.dtype),
                 in_shardings=(setup.state_shardings, setup.batch_sharding))
    return lambda state, batch, total: jitted(state, batch)


def train_and_evaluate(config, workdir: str) -> dict:
    config_lib.validate(config)
    maybe_initialize_distributed()
    os.makedirs(workdir, exist_ok=True)
    lead = jax.process_index() == 0
    if lead:
        config_lib.save_config(config, workdir)

    t = config.train
    setup = make_setup(config)
    train_iter = data.make_train_iterator(config, process_index=jax.process_index(),
                                          process_count=jax.process_count())
    eval_batches = data.make_eval_batches(config, process_index=jax.process_index(),
                                          process_count=jax.process_count())
    if data.vocab_size(config) != config.model.vocab_size:
        raise UserError(f"the tokenizer has {data.vocab_size(config)} pieces but model.vocab_size is "
                        f"{config.model.vocab_size}; set --config.data.vocab_size={data.vocab_size(config)}")
    evaluate = make_evaluator(setup)

    ckpt = Checkpointer(workdir, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    run_id, planned = None, None
    budgeted = t.get("time_budget_s", 0) > 0  # configs saved before the key: no budget
    if ckpt.steps():
        step, state, meta = ckpt.restore(setup.abstract_state, train_iter)
        run_id = meta.get("wandb_run_id")
        saved = meta.get("budget")  # a time-budgeted run keeps the total it chose...
        if saved and budgeted and saved["configured_steps"] == t.steps:
            planned = saved["planned_steps"]
        elif saved and lead:  # ...unless the rerun changed the budget or the steps
            print(f"the checkpoint's run chose {saved['planned_steps']} of {saved['configured_steps']} steps "
                  f"for its time budget; with train.steps={t.steps} and train.time_budget_s="
                  f"{t.get('time_budget_s', 0):g} this run plans anew", flush=True)
        logging.info("resumed from step %d in %s", step, workdir)
        if lead:
            print(f"resuming from checkpoint at step {step}", flush=True)
    else:
        state, step = setup.init_state(), 0
    step = int(step)

    tokens_per_step = t.batch_size * t.seq_len
    peak = t.peak_gflops or flops_lib.measure_matmul_gflops()
    total = int(planned or t.steps)  # the run's last step (time_budget_s may lower it, once)
    planner = BudgetPlanner(t) if budgeted and planned is None else None
    progress = Progress(total, step, tokens_per_step,
                        flops_lib.flops_per_token(config.model, setup.abstract_state["params"], t.seq_len),
                        flops_lib.run_peak_flops(peak), enabled=lead and config.logging.progress)
    writer = MetricsWriter(workdir, step) if lead else None
    wandb = Wandb(config, workdir, run_id) if lead else None
    meta = {"config": config.to_dict(), "wandb_run_id": wandb.run_id if wandb else run_id}
    if planned:
        meta["budget"] = {"planned_steps": total, "configured_steps": t.steps}
    if lead:
        print(f"{config.model.family}: {setup.n_params / 1e6:.2f}M parameters, mesh "
              f"{dict(setup.mesh.shape)}, {tokens_per_step} tokens/step, steps {step}->{total}",
              flush=True)
        print(f"sharding: {sharding_summary(state['params'])}", flush=True)

    train_step = make_jitted_step(setup, budgeted=budgeted)

    def log(record):
        if lead:
            writer.write(record)
            wandb.log(record, record["step"])

    def run_eval(step):
        result = evaluate(state["params"], eval_batches)
        log({"step": step, **{f"eval_{k}": v for k, v in result.items()}})
        if lead and config.logging.progress:
            extra = f", MQAR accuracy {result['mqar_accuracy']:.4f}" if "mqar_accuracy" in result else ""
            print(f"eval at step {step}: loss {result['loss']:.4f}, perplexity "
                  f"{result['perplexity']:.2f}{extra}", flush=True)
        return result

    start_time, stopped, compiling = time.perf_counter(), None, True
    with _StopFlag() as stop:
        while step < total:
            began = time.perf_counter()  # a timed step includes making its batch
            batch = next(train_iter)
            timed = planner is not None and planner.wants_timing(batch["inputs"].shape)
            state, metrics = train_step(state, setup.put_batch(batch), total)
            step += 1
            if compiling or timed:  # compilation stays out of the first throughput figure; timed steps end here
                jax.block_until_ready(metrics)
            if compiling:
                progress.reset_clock(step)
                compiling = False
            if timed and (chosen := planner.observe(step, batch["inputs"].shape,
                                                    time.perf_counter() - began)) is not None:
                if jax.process_count() > 1:  # every process takes process 0's choice
                    chosen = int(multihost_utils.broadcast_one_to_all(np.int32(chosen)))
                total = progress.total = chosen
                meta["budget"] = {"planned_steps": chosen, "configured_steps": t.steps}
                if lead:
                    print(planner.describe(step, chosen), flush=True)
                    with open(os.path.join(workdir, "budget.json"), "w") as f:
                        json.dump({"planned_steps": chosen, "configured_steps": t.steps, "at_step": step}, f)
                planner = None
            stopping = stop.signal  # read once: a signal arriving later waits for the next step
            will_save = step % config.checkpoint.every_steps == 0 or step == total or stopping
            if step % t.log_every == 0 or will_save:
                record = {k: float(v) for k, v in jax.device_get(metrics).items()}
                # A non-finite loss or gradient stops the run before it can reach a checkpoint.
                for name in ("loss", "grad_norm"):
                    if not math.isfinite(record[name]):
                        ckpt.wait()
                        raise UserError(f"training {name.replace('_', ' ')} became {record[name]} at step {step}; "
                                        f"checkpoints up to step {max(ckpt.steps(), default=0)} are intact "
                                        "(lower train.lr or the memory's max_lr and resume)")
            if step % t.log_every == 0 or step == total:
                record = progress.update(step, record)
                record["step"] = step
                log(record)
            if t.eval_every and step % t.eval_every == 0 and step != total:
                eval_began = time.perf_counter()
                run_eval(step)
                if planner is not None:
                    planner.record_eval(time.perf_counter() - eval_began)
                progress.reset_clock(step)
            if step % config.checkpoint.every_steps == 0 or step == total:
                ckpt.save(step, state, train_iter, meta)
            if stopping:
                stopped = stopping
                ckpt.save(step, state, train_iter, meta, force=True)
                break
    ckpt.wait()
    if stopped:
        ckpt.close()
        if lead:
            print(f"received {stopped}: saved a checkpoint at step {step}; rerun the same command to resume",
                  flush=True)
        return {"step": step, "stopped": stopped}
    if not t.get("final_eval", True):  # configs saved before the key evaluated at the end
        ckpt.close()
        if lead:
            print(f"trained to step {step}; score it with nlearn-eval --workdir={workdir}", flush=True)
        return {"step": step, "train_seconds": time.perf_counter() - start_time}

    result = run_eval(step)
    result["step"] = step
    result["train_seconds"] = time.perf_counter() - start_time
    ckpt.close()
    if lead:
        with open(os.path.join(workdir, "eval.json"), "w") as f:
            json.dump(result, f, indent=2)
        if config.logging.plot:
            plot_losses(workdir)
        wandb.finish()
    return result
