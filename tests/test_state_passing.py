"""train.state_passing: a row that continues its carried state scores its window exactly as the same window
read after the tokens that made the state; fresh rows as a plain forward; bad values refused; a run with it
resumes exactly (a run without it can turn it on)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from run_helpers import ROOT, kill_after_checkpoint_and_resume, load_family_config, tiny_overrides
from nlearn import config as config_lib
from nlearn import models
from nlearn.errors import UserError
from nlearn.train import state_passing as sp
from nlearn.train.state import make_setup
from nlearn.train.step import make_train_step, token_losses
from flax import nnx


def small_config(family="deltanet", probability=0.5):
    config = load_family_config(family)
    with config.unlocked():
        config.data.vocab_size = 61
        config.model.update(vocab_size=61, d_model=32, num_layers=2, num_heads=2, mlp_dim=64)
        config.model.memory.chunk_size = 4
        config.train.update(batch_size=4, seq_len=11, warmup_steps=0, state_passing=probability)
    return config


def decoded_state(graphdef, params, x_BT, cache_len):
    """The model's state after decoding `x_BT` from a fresh cache (made for windows of `cache_len`)."""
    model = nnx.merge(graphdef, params)
    return model.decode(x_BT, model.init_cache(x_BT.shape[0], cache_len))[1]


def test_a_kept_row_continues_its_state_and_a_fresh_row_starts_over():
    """The step's loss is the mean over rows of: the last window's losses of a plain forward over
    prefix + window (kept rows: their carry was made by decoding the prefix), or of the window alone
    (fresh rows); the carry it leaves is each row's state after what it read."""
    config = small_config()
    setup = make_setup(config)
    state = setup.init_state()
    rng = np.random.default_rng(0)
    prefix = jnp.asarray(rng.integers(0, 61, (4, 13)), jnp.int32)  # divides no chunk, like the window
    window = jnp.asarray(rng.integers(0, 61, (4, 12)), jnp.int32)
    final_state = jax.jit(lambda params, x, cache_len=11: decoded_state(setup.graphdef, params, x, cache_len),
                          static_argnums=2)  # jitted: a few compiles instead of ~300 eager ones
    state["carry"] = final_state(state["params"], prefix)
    keep = np.asarray(sp.keep_rows(state["rng"], state["step"], 4, 0.5))
    assert 0 < keep.sum() < 4  # this seed's first draw mixes both kinds of row

    step = jax.jit(make_train_step(config, setup.graphdef, setup.optimizer))
    batch = {"inputs": window[:, :-1], "targets": window[:, 1:]}
    new_state, metrics = step(state, batch)

    params = state["params"]
    losses = jax.jit(lambda x, y: token_losses(setup.graphdef, params, x, y, jnp.float32))
    whole = losses(jnp.concatenate([prefix, window[:, :-1]], 1),
                   jnp.concatenate([prefix[:, 1:], window[:, :1], window[:, 1:]], 1))[:, 13:]
    alone = losses(window[:, :-1], window[:, 1:])
    expected = np.where(keep[:, None], np.asarray(whole), np.asarray(alone)).mean()
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
    assert float(metrics["passed_rows"]) == keep.mean()

    after_prefix = final_state(params, jnp.concatenate([prefix, window[:, :-1]], 1))
    after_window = final_state(params, window[:, :-1])
    for got, long, short in zip(jax.tree.leaves(new_state["carry"]), jax.tree.leaves(after_prefix),
                                jax.tree.leaves(after_window)):
        want = np.where(keep.reshape((4,) + (1,) * (long.ndim - 1)), long, short)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)

    # A curriculum stage of shorter windows has more rows than the carry: the extra rows start fresh, and the
    # carry keeps its rows (the first ones now hold this batch's final states).
    wide = jnp.asarray(rng.integers(0, 61, (8, 6)), jnp.int32)
    after, wide_metrics = step(new_state, {"inputs": wide[:, :-1], "targets": wide[:, 1:]})
    assert np.isfinite(float(wide_metrics["loss"]))
    fresh_wide = final_state(new_state["params"], wide[:, :-1], 5)
    keep = np.asarray(sp.keep_rows(new_state["rng"], new_state["step"], 8, 0.5))
    for got, fresh in zip(jax.tree.leaves(after["carry"]), jax.tree.leaves(fresh_wide)):
        assert got.shape[0] == 4
        fresh_rows = ~keep[:4]
        if fresh_rows.any():  # fresh rows end as a fresh decode of the window
            np.testing.assert_allclose(np.asarray(got)[fresh_rows], np.asarray(fresh)[:4][fresh_rows],
                                       rtol=2e-5, atol=2e-6)


@pytest.mark.slow  # 50-95 s a family; the default suite passes states through test_a_kept_row_continues_its_state...
@pytest.mark.parametrize("family", ["titans_lmm", "titans_mac"])
def test_a_shared_position_passes_states_only_where_a_fresh_row_starts(family):
    """titans_lmm keeps its place in the current mini-batch once for all rows (`pos`), titans_mac also its
    stream position (`next`, which counts from its segment's start once rebased: with RoPE positions counted
    from each segment's start, `model.mac_positions="segment"`, no output depends on more). After a prefix
    that ends a mini-batch and a segment a kept row continues exactly as streaming would; from a carry whose place is
    inside a mini-batch no row can continue, every row reads its window from the fresh state and the step's
    `passing_blocked` says so."""
    config = small_config(family)
    with config.unlocked():
        config.model.memory.minibatch = 4
        if family == "titans_mac":
            config.model.update(segment_len=4, mac_positions="segment")
    setup = make_setup(config)
    state = setup.init_state()
    axes = sp.batch_axes(config)
    assert sp.SHARED in jax.tree.leaves(axes)
    step = jax.jit(make_train_step(config, setup.graphdef, setup.optimizer))
    model = nnx.merge(setup.graphdef, state["params"])
    keep = np.asarray(sp.keep_rows(state["rng"], state["step"], 4, 0.5))
    assert 0 < keep.sum() < 4
    rng = np.random.default_rng(1)
    prefix = jnp.asarray(rng.integers(0, 61, (4, 12)), jnp.int32)  # three whole mini-batches
    window = jnp.asarray(rng.integers(0, 61, (4, 10)), jnp.int32)  # 9 inputs: ends inside a mini-batch
    _, carry = model.decode(prefix, model.init_cache(4, 11))
    carry = jax.tree.map(lambda x: x.astype(jnp.float32), carry)
    whole = np.asarray(token_losses(setup.graphdef, state["params"], jnp.concatenate([prefix, window[:, :-1]], 1),
                                    jnp.concatenate([prefix[:, 1:], window[:, :1], window[:, 1:]], 1),
                                    jnp.float32))[:, 12:]
    alone = np.asarray(token_losses(setup.graphdef, state["params"], window[:, :-1], window[:, 1:], jnp.float32))
    _, streamed = model.decode(jnp.concatenate([prefix, window[:, :-1]], 1), model.init_cache(4, 11))

    def as_cache(c):  # the carry is kept in float32; the model reads its counters as ints
        return jax.tree.map(lambda x, f: x.astype(f.dtype), c, model.init_cache(4, 11))

    _, after_both = model.decode(window[:, :-1], model.rebase_cache(as_cache(carry)))  # counted from the prefix
    _, after_window = model.decode(window[:, :-1], model.init_cache(4, 11))
    more = jnp.asarray(rng.integers(0, 61, (4, 3)), jnp.int32)
    streamed_logits = np.asarray(model.decode(more, streamed)[0])
    inside = jax.tree.map(lambda x, axis: x + 1 if axis == sp.SHARED else x, carry, axes)  # pos = 1
    for start, kept in ((carry, keep), (inside, np.zeros(4, bool))):
        new_state, metrics = step(dict(state, carry=start), {"inputs": window[:, :-1], "targets": window[:, 1:]})
        np.testing.assert_allclose(float(metrics["loss"]), np.where(kept[:, None], whole, alone).mean(), rtol=1e-5)
        assert float(metrics["passed_rows"]) == kept.mean()
        assert float(metrics["passing_blocked"]) == (not kept.any())
        rebased = [model.rebase_cache(c) for c in (new_state["carry"], after_both)]
        for got, long, short, axis in zip(*map(jax.tree.leaves, (*rebased, after_window, axes))):
            if axis == sp.SHARED:  # carried: where this window ended, in its mini-batch and segment
                assert float(got) == float(long) == 9 % 4
            else:  # each row's memory after what it read: prefix and window, or the window alone
                want = np.where(kept.reshape((4,) + (1,) * (long.ndim - 1)), long, short)
                np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-6)
        # A kept row's carry reads on as the stream that never restarted its count (mid-segment, mid-mini-batch).
        logits = np.asarray(model.decode(more, as_cache(new_state["carry"]))[0])
        np.testing.assert_allclose(logits[kept], streamed_logits[kept], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family, model, passes", [
    ("ttt_linear", {}, True), ("ttt_mlp", {}, True), ("self_ref_titans", {}, True),
    ("titans_mac", {"mac_positions": "segment"}, True),
    ("titans_mac", {"mac_positions": "absolute"}, False),  # RoPE's rotation depends on the stream position
    pytest.param("hope", {}, False, marks=pytest.mark.slow),  # its CMS counts every token read (~28 s)
])
def test_which_families_can_pass_states(family, model, passes):
    """After a window that is a multiple of the mini-batch (4) and of self_ref_titans' chunk period (64), the
    shared leaves of a memory's state are back where a fresh row starts (README: which families
    train.state_passing serves)."""
    config = small_config(family)
    config.model.update(model)
    if "minibatch" in config.model.memory:
        config.model.memory.minibatch = 4
    model = models.build(config)
    fresh = model.init_cache(2, 64)
    graphdef, params = nnx.split(model)
    final = jax.jit(lambda p, x: decoded_state(graphdef, p, x, 64))(  # jitted: one compile, not one per op
        params, jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 64)), jnp.int32))
    assert bool(sp.shared_leaves_agree(model.rebase_cache(final), fresh, sp.batch_axes(config))) == passes


def test_rows_are_drawn_from_the_run_rng_and_step_at_the_given_rate():
    rng = jax.random.key_data(jax.random.key(3))
    draws = np.stack([np.asarray(sp.keep_rows(rng, jnp.int32(s), 64, 0.9)) for s in range(50)])
    assert np.array_equal(draws[7], np.asarray(sp.keep_rows(rng, jnp.int32(7), 64, 0.9)))  # resumable
    assert not np.array_equal(draws[7], draws[8])
    assert abs(draws.mean() - 0.9) < 0.03
    late = [bool(np.asarray(sp.keep_rows(rng, jnp.int32(s), 64, 0.9, first_step=20)).any()) for s in range(50)]
    assert late == [s >= 20 for s in range(50)]  # train.state_passing_from: none before that step


@pytest.mark.parametrize("family, overrides, message", [
    ("deltanet", {"state_passing": 1.0}, "train.state_passing=1.0: must be in [0, 1)"),
    ("deltanet", {"state_passing": -0.1}, "train.state_passing=-0.1: must be in [0, 1)"),
    ("deltanet", {"state_passing": 0.5, "grad_accum": 2}, "needs train.grad_accum=1"),
    ("deltanet", {"state_passing": 0.5, "state_passing_from": -1}, "train.state_passing_from=-1: must be >= 0"),
    ("transformer", {"state_passing": 0.5}, "family 'transformer' keeps a cache that grows"),
])
def test_bad_state_passing_is_refused_with_one_line(family, overrides, message):
    config = load_family_config(family)
    with config.unlocked():
        config.train.update(**overrides)
    with pytest.raises(UserError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        config_lib.validate(config)


@pytest.mark.slow  # ~100 s: three CLI runs; the plain path's exact resume is tests/test_train.py's (default suite)
def test_a_run_with_state_passing_resumes_exactly_and_a_run_without_it_can_start_it(
        tmp_path, cache_dir, text_corpus):
    """12 steps straight == killed after the step-6 checkpoint and rerun (the carried states come back from
    the checkpoint); a checkpoint written without state passing resumes with it, its rows starting fresh."""
    def cmd(workdir, passing=0.75, steps=12):
        return [sys.executable, "-m", "nlearn.cli.train", "--config=configs/deltanet.py:tiny", f"--workdir={workdir}",
                *tiny_overrides(cache_dir, text_corpus, **{"train.steps": steps, "train.state_passing": passing})]

    def final_line(proc):
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [line for line in proc.stdout.splitlines() if line.startswith("final:")][0]

    straight = subprocess.run(cmd(tmp_path / "straight"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    resumed = kill_after_checkpoint_and_resume(tmp_path / "killed", cmd(tmp_path / "killed"), 6)
    assert final_line(resumed) == final_line(straight)

    first = subprocess.run(cmd(tmp_path / "late", 0.0, 6), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    late = subprocess.run(cmd(tmp_path / "late"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert "carries no recurrent states" in late.stdout
    final_line(late)


@pytest.mark.slow  # two more runs; the sharded plain run is tests/test_train.py's
def test_state_passing_on_a_sharded_batch_matches_one_device(tmp_path, cache_dir, text_corpus):
    """The carried states stay replicated while the batch is split over data=4 x fsdp=2 host devices: the
    run ends at the single-device loss."""
    def run(workdir, devices, **mesh):
        cmd = [sys.executable, "-m", "nlearn.cli.train", "--config=configs/deltanet.py:tiny", f"--workdir={workdir}",
               *tiny_overrides(cache_dir, text_corpus, **{"train.steps": 8, "train.state_passing": 0.75, **mesh})]
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return json.load(open(workdir / "eval.json"))["loss"]

    single = run(tmp_path / "one", 1)
    sharded = run(tmp_path / "eight", 8, **{"mesh.data": 4, "mesh.fsdp": 2})
    assert abs(sharded - single) / single <= 1e-3
