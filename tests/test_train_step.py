"""The one train step (nlearn.train.step.make_train_step) as the trainer's hooks jit it: every option the
config sets reaches it, with or without a wall-time budget."""

import jax
import jax.numpy as jnp
import numpy as np

from run_helpers import load_family_config
from nlearn import config as config_lib
from nlearn.train.hooks import StepHook, make_hook
from nlearn.train.state import make_setup
from nlearn.train.time_budget import TimeBudget


def small(config, **train):
    with config.unlocked():
        config.data.vocab_size = 61
        config.model.update(vocab_size=61, d_model=16, num_layers=1, num_heads=2, mlp_dim=32)
        config.model.memory.chunk_size = 4
        config.train.update(batch_size=4, seq_len=11, warmup_steps=2, schedule="wsd", decay_steps=0,
                            **train)
    config_lib.validate(config)
    return config


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        window = jnp.asarray(rng.integers(0, 61, (4, 12)), jnp.int32)
        yield {"inputs": window[:, :-1], "targets": window[:, 1:],
               "weights": jnp.asarray(rng.random((4, 11)) < 0.7, jnp.float32)}


def metrics_at(config, tmp_path, steps, budget_s):
    """`{n: (carry, metrics)}` of one call of the trainer's jitted step (its hook from `config`, with
    `train.time_budget_s=budget_s`) at step n, each from the same initial state (the carried states, if any,
    moved off a fresh row's)."""
    with config.unlocked():
        config.train.time_budget_s = budget_s
    setup = make_setup(config)
    hook = make_hook(config, str(tmp_path), lead=True)
    hook.plan(None)
    assert type(hook) is (TimeBudget if budget_s else StepHook)
    step = hook.jit_step(setup)
    start = setup.init_state()
    if "carry" in start:
        start["carry"] = jax.tree.map(lambda x: x + 0.1, start["carry"])
    batch = setup.put_batch(next(batches(1)))
    out = {}
    for n in steps:
        state = jax.tree.map(jnp.copy, dict(start, step=jnp.asarray(n, jnp.int32)))  # the step donates its state
        new_state, metrics = step(state, batch)
        out[n] = (jax.device_get(new_state.get("carry")), {k: float(v) for k, v in jax.device_get(metrics).items()})
    return out, start


def assert_same_with_and_without_a_budget(config, tmp_path, steps):
    """The step's metrics and carried states at each of `steps`, with and without a time budget; the plain
    run's `(metrics_at, start state)`."""
    plain, start = metrics_at(config, tmp_path, steps, 0.0)
    budget, _ = metrics_at(config, tmp_path, steps, 3600.0)
    for n in steps:
        assert budget[n][1].keys() == plain[n][1].keys()
        for key, want in plain[n][1].items():
            np.testing.assert_allclose(budget[n][1][key], want, rtol=1e-6, err_msg=f"step {n}: {key}")
        for got, want in zip(jax.tree.leaves(budget[n][0]), jax.tree.leaves(plain[n][0])):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    return plain, start


def test_a_time_budget_keeps_micro_batches_and_the_write_cost(tmp_path):
    """grad_accum=2 with the write cost (state passing needs grad_accum=1: config.validate refuses the three):
    the same loss, gradient norm and write cost whether or not the run has a time budget."""
    config = small(load_family_config("deltanet"), grad_accum=2, write_penalty=0.5)
    plain, _ = assert_same_with_and_without_a_budget(config, tmp_path, [0])
    assert set(plain[0][1]) == {"loss", "grad_norm", "write_cost"} and plain[0][1]["write_cost"] > 0


def test_the_niah_deltanet_preset_with_a_time_budget_charges_the_write_cost_and_passes_states(tmp_path):
    """benchmarks/configs/niah.py:deltanet (write cost from step 3000, state passing from 4500), with and without a time
    budget: the same step, which charges the cost from step 3000 on (same cross-entropy, another gradient) and
    continues the carried states from step 4500 on (another loss, the carry replaced by the final states)."""
    config = small(load_family_config("niah", "deltanet", "benchmarks/configs"))
    t = config.train
    assert t.write_penalty > 0 and t.state_passing > 0 and t.write_penalty_from < t.state_passing_from
    steps = [t.write_penalty_from - 1, t.write_penalty_from, t.state_passing_from - 1, t.state_passing_from]
    at, start = assert_same_with_and_without_a_budget(config, tmp_path, steps)
    before, charged = at[t.write_penalty_from - 1][1], at[t.write_penalty_from][1]
    assert charged["write_cost"] > 0 and charged["passed_rows"] == before["passed_rows"] == 0
    assert charged["loss"] == before["loss"] and abs(charged["grad_norm"] - before["grad_norm"]) > 1e-6
    (_, fresh), (carry, passed) = at[t.state_passing_from - 1], at[t.state_passing_from]
    assert 0 < passed["passed_rows"] <= 1 and passed["loss"] != fresh["loss"]
    assert not any(np.allclose(a, b) for a, b in zip(jax.tree.leaves(carry), jax.tree.leaves(start["carry"])))
