"""train.write_penalty: the cost is each layer's mean write strength as the gate makes it (the delta rules' beta,
the Titans and TTT memories' learning rate), charged from its first step on both train steps (plain and state
passing), it closes write gates by itself, and bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from run_helpers import load_family_config
from nlearn import config as config_lib
from nlearn.errors import UserError
from nlearn.train.state import make_setup
from nlearn.train import write_penalty as wp
from nlearn.train.step import make_train_step, token_losses_and_write_cost


def small_config(family="deltanet", **train):
    config = load_family_config(family)
    with config.unlocked():
        config.data.vocab_size = 61
        config.model.update(vocab_size=61, d_model=32, num_layers=2, num_heads=2, mlp_dim=64)
        gate = "beta_gate" if "beta_gate" in config.model.memory else "lr_gate"
        chunks = dict(chunk_memory=4, chunk_other=4) if "chunk_other" in config.model.memory else dict(chunk_size=4)
        config.model.memory.update(**chunks, **{gate: "hard_sigmoid"})
        config.train.update(batch_size=4, seq_len=11, warmup_steps=0, lr=1e-2, **train)
    return config


def tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 61, shape), jnp.int32)


def gate_logits_by_layer(model, tokens_BT):
    """Each layer's write-gate logits `[B, T, H]`, from the blocks' inputs as decoding sees them."""
    logits = []

    def probe(block, x, cache):
        logits.append(np.asarray(block.mixer.write_logits(block.mixer_norm(x))))

    model.decode(tokens_BT, model.init_cache(tokens_BT.shape[0], tokens_BT.shape[1]), probe=probe)
    return logits


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "remat"])
def test_the_write_cost_is_each_layers_mean_gate_strength_summed(remat):
    """hard_sigmoid: relu(z + 4) / 6 per token and head (unclipped above, a unit past the gate's closing edge);
    rematerialised blocks report it too."""
    config = small_config()
    with config.unlocked():
        config.model.remat = remat
    setup = make_setup(config)
    params = setup.init_state()["params"]
    x = tokens((4, 10))
    _, cost = token_losses_and_write_cost(setup.graphdef, params, x, x, jnp.float32)
    z = gate_logits_by_layer(nnx.merge(setup.graphdef, params), x)
    assert len(z) == 2
    np.testing.assert_allclose(float(cost), sum(np.mean(np.maximum(zl + 4.0, 0.0) / 6.0) for zl in z), rtol=1e-5)


@pytest.mark.parametrize("family", ["titans_mac", "ttt_linear", "self_ref_titans"] + [  # MAC's segment scan; own layers
    pytest.param(f, marks=pytest.mark.slow) for f in ("titans_lmm", "titans_mag", "titans_mal", "ttt_mlp", "hope")])
def test_every_gated_memory_charges_its_learning_rate_gate(family):
    """With every lr gate constant (kernel 0, bias b) each layer charges relu(b + 4) / 6, Titans MAC (whose memory
    runs inside its segment scan) included; a gate below -4 charges nothing."""
    cost_with_bias = constant_gate_cost(small_config(family))
    np.testing.assert_allclose(cost_with_bias(-1.5), 2 * 2.5 / 6, rtol=1e-5)
    assert cost_with_bias(-4.5) == 0.0


def constant_gate_cost(config):
    """`bias -> the write cost of a window of 10 tokens` with every lr gate's kernel 0 and its bias `bias` (one
    model, initialised once)."""
    setup = make_setup(config)
    params = setup.init_state()["params"]
    x = tokens((4, 10))

    def cost_with_bias(bias: float) -> float:
        def set_gate(path, leaf):
            names = [str(getattr(p, "key", p)) for p in path]
            if "lr_gate" not in names:
                return leaf
            return jnp.full_like(leaf, bias) if names[-1] == "bias" else jnp.zeros_like(leaf)

        gated = jax.tree_util.tree_map_with_path(set_gate, params)
        return float(token_losses_and_write_cost(setup.graphdef, gated, x, x, jnp.float32)[1])

    return cost_with_bias


def test_hope_charges_its_mixers_once_while_its_cms_learns_in_context():
    """With CMS periods shorter than the window, Hope's pass 1 runs its mixers inside a scan under a grad (where
    nothing may be sown): the cost is pass 2's, once per layer, and a train step runs with it."""
    config = small_config("hope", write_penalty=1.0)
    with config.unlocked():
        config.model.cms.periods = (4, 8)
    np.testing.assert_allclose(constant_gate_cost(config)(-1.5), 2 * 2.5 / 6, rtol=1e-5)
    history = run_steps(config, 2)[2]
    assert np.isfinite(history[-1]["loss"]) and history[-1]["write_cost"] > 0


def run_steps(config, n, seed=0):
    setup = make_setup(config)
    state = setup.init_state()
    step = jax.jit(make_train_step(config, setup.graphdef, setup.optimizer))
    history = []
    for i in range(n):
        window = tokens((4, 12), seed + i)
        state, metrics = step(state, {"inputs": window[:, :-1], "targets": window[:, 1:]})
        history.append(jax.device_get(metrics))
    return setup, state, history


@pytest.mark.parametrize("passing", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "state_passing"])
def test_the_cost_is_charged_from_its_first_step_and_the_loss_metric_stays_the_cross_entropy(passing):
    extra = dict(state_passing=0.5) if passing else {}
    _, plain, plain_history = run_steps(small_config(**extra), 3)
    _, charged, charged_history = run_steps(small_config(write_penalty=5.0, write_penalty_from=2, **extra), 3)
    leaves = lambda state: jax.tree.leaves(state["params"])  # noqa: E731
    for step in (0, 1):  # before write_penalty_from: the same steps (two programs: equal up to float32 sum order;
        # a cost of 5 charged at step 0 would move step 1's loss by far more)
        np.testing.assert_allclose(charged_history[step]["loss"], plain_history[step]["loss"], rtol=1e-6)
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(plain), leaves(charged)))
    # the third step's loss metric is the cross-entropy alone, which both runs compute from the same params
    np.testing.assert_allclose(charged_history[2]["loss"], plain_history[2]["loss"], rtol=1e-6)
    assert charged_history[2]["write_cost"] > 0


@pytest.mark.parametrize("family", ["deltanet", "titans_lmm"])
def test_the_cost_alone_closes_every_write_gate_exactly(family):
    """A heavy cost (and answers of no use to any write) drives every gate past its edge: the write is exactly 0."""
    config = small_config(family, write_penalty=100.0)
    setup, state, history = run_steps(config, 60)
    assert history[-1]["write_cost"] < 0.1 * history[0]["write_cost"]
    x = tokens((4, 10), 99)
    z = gate_logits_by_layer(nnx.merge(setup.graphdef, state["params"]), x)
    beta = [np.asarray(jax.nn.hard_sigmoid(zl)) for zl in z]
    assert all((b == 0).all() for b in beta)
    _, uncharged, _ = run_steps(small_config(family), 60)  # without the cost, the gates stay open
    z = gate_logits_by_layer(nnx.merge(setup.graphdef, uncharged["params"]), x)
    assert all((np.asarray(jax.nn.hard_sigmoid(zl)) > 0).mean() > 0.5 for zl in z)


@pytest.mark.parametrize("family, overrides, culprit", [
    ("deltanet", dict(write_penalty=-0.1), "train.write_penalty=-0.1"),
    ("deltanet", dict(write_penalty=0.1, write_penalty_from=-1), "train.write_penalty_from=-1"),
    ("linear_attention", dict(write_penalty=0.1), "has no write gate"),
    ("transformer", dict(write_penalty=0.1), "has no write gate"),
    ("self_ref_titans", dict(write_penalty=0.1), "model.memory.lr_gate='none'"),  # the default: no layer gate
    ("hope", dict(write_penalty=0.1), "model.memory.lr_gate='none'"),
    ("hope", dict(write_penalty=0.1, state_passing=0.5, lr_gate="hard_sigmoid"), "no write cost while decoding"),
])
def test_bad_settings_are_refused_with_the_culprit(family, overrides, culprit):
    config = load_family_config(family)
    with config.unlocked():
        if "lr_gate" in overrides:
            config.model.memory.lr_gate = overrides.pop("lr_gate")
        config.train.update(**overrides)
    with pytest.raises(UserError, match=culprit):
        config_lib.validate(config)


def test_titans_mac_reports_its_write_cost_while_decoding():
    """MAC's memory runs inside its decoding branches (whole segments at once, or token by token from mid-segment):
    both report the mean cost its training forward does, so the cost and train.state_passing combine."""
    config = small_config("titans_mac")
    with config.unlocked():
        config.model.mac_positions = "segment"
        config.train.update(write_penalty=0.1, state_passing=0.5)
    config_lib.validate(config)
    setup = make_setup(config)
    model = nnx.merge(setup.graphdef, setup.init_state()["params"])
    c = config.model.segment_len
    x = tokens((2, 2 * c))
    _, forward = wp.run_costed(model.__call__, x)
    (_, cache), whole = wp.run_costed(model.decode, x, model.init_cache(2, 2 * c))
    (_, cache), first = wp.run_costed(model.decode, x[:, :1], model.init_cache(2, 2 * c))
    _, rest = wp.run_costed(model.decode, x[:, 1:], cache)
    assert float(forward) > 0
    np.testing.assert_allclose(float(whole), float(forward), rtol=1e-5)
    np.testing.assert_allclose((float(first) + (2 * c - 1) * float(rest)) / (2 * c), float(forward), rtol=1e-5)


def test_scanned_layers_are_refused():
    config = load_family_config("deltanet")
    with config.unlocked():
        config.model.scan_layers = True
        config.train.write_penalty = 0.1
    with pytest.raises(UserError, match="scan_layers=False"):
        config_lib.validate(config)


def test_micro_batches_report_the_same_loss_and_cost_as_one_batch():
    """grad_accum=2 sums each half's share: the cross-entropy and the write cost of the whole batch."""
    _, _, whole = run_steps(small_config(write_penalty=5.0), 1)
    _, _, halves = run_steps(small_config(write_penalty=5.0, grad_accum=2), 1)
    for key in ("loss", "write_cost"):
        np.testing.assert_allclose(halves[0][key], whole[0][key], rtol=1e-5)


def test_self_referential_titans_reports_its_write_cost_while_decoding():
    """The layer gate's cost from a whole prompt or token by token equals the training forward's, so the cost
    and train.state_passing combine for self_ref_titans."""
    config = small_config("self_ref_titans")
    with config.unlocked():
        config.model.memory.gate_conv = True
        config.train.update(write_penalty=0.1, state_passing=0.5)
    config_lib.validate(config)
    setup = make_setup(config)
    model = nnx.merge(setup.graphdef, setup.init_state()["params"])
    x = tokens((2, 6))
    _, forward = wp.run_costed(model.__call__, x)
    (_, cache), first = wp.run_costed(model.decode, x[:, :5], model.init_cache(2, 6))
    _, last = wp.run_costed(model.decode, x[:, 5:], cache)
    assert float(forward) > 0
    np.testing.assert_allclose((5 * float(first) + float(last)) / 6, float(forward), rtol=1e-5)
