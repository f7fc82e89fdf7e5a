"""The inner learner's config defaults: max_lr follows the memory depth unless set."""

import pytest

from nlearn.memory_config import neural_memory_config
from run_helpers import load_family_config


@pytest.mark.parametrize("depth, expected", [(1, 1.0), (2, 0.25), (3, 1.0 / 9)])
def test_max_lr_follows_depth(depth, expected):
    config = neural_memory_config()
    config.depth = depth  # as a --config.model.memory.depth override does
    assert config.max_lr == pytest.approx(expected)
    assert neural_memory_config(depth=depth).max_lr == pytest.approx(expected)


def test_explicit_max_lr_wins():
    config = neural_memory_config()
    config.max_lr = 0.2
    config.depth = 3
    assert config.max_lr == 0.2
    assert neural_memory_config(max_lr=0.05, depth=3).max_lr == 0.05


def test_conv_init_choices():
    """Both short-conv inits build; an unknown one is refused naming the key."""
    import jax.numpy as jnp
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.errors import UserError
    from nlearn.layers.conv import ShortConv

    identity = ShortConv(8, 4, rngs=nnx.Rngs(0)).weight[...]
    assert jnp.allclose(identity[-1], 1.0, atol=0.1) and jnp.all(jnp.abs(identity[:-1]) < 0.1)
    uniform = ShortConv(8, 4, init="uniform", rngs=nnx.Rngs(0)).weight[...]
    assert jnp.all(jnp.abs(uniform) <= 0.5) and float(jnp.std(uniform)) > 0.1

    config = load_family_config("deltanet")
    config.model.memory.conv_init = "uniform"
    config_lib.validate(config)
    config.model.memory.conv_init = "zeros"
    with pytest.raises(UserError, match="model.memory.conv_init='zeros'"):
        config_lib.validate(config)


def test_delta_rule_qk_activation():
    """SiLU (the default) makes unit keys that all overlap; identity's signed ones are near orthogonal on
    random input; an unknown choice is refused naming the key."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.errors import UserError
    from nlearn.layers.mixers import DeltaNetMixer

    def mean_key_overlap(model_config):  # mean cosine between distinct tokens' keys, per head
        x = 10 * jax.random.normal(jax.random.key(0), (1, 64, model_config.d_model))  # O(1) pre-activations
        k = DeltaNetMixer(model_config, rngs=nnx.Rngs(0)).project(x)[1][0]  # [T, H, D]
        assert jnp.allclose(jnp.linalg.norm(k, axis=-1), 1.0, atol=1e-4)
        cos = jnp.einsum("thd,shd->hts", k, k)
        return float((cos.sum() - cos.trace(axis1=1, axis2=2).sum()) / (cos.size - cos.shape[0] * 64))

    config = load_family_config("deltanet")
    assert mean_key_overlap(config.model) > 0.2
    config.model.memory.qk_activation = "identity"
    config_lib.validate(config)
    assert abs(mean_key_overlap(config.model)) < 0.1
    config.model.memory.qk_activation = "tanh"
    with pytest.raises(UserError, match="model.memory.qk_activation='tanh'"):
        config_lib.validate(config)


def test_delta_rule_relu_keys_keep_an_untouched_coordinate_exactly():
    """memory.qk_activation='relu' gives keys exact zeros (SiLU never does), and the state's row along a key
    coordinate that no later key touches is kept exactly: a needle written there survives any number of writes
    (chunked op, 1000 tokens that divide no chunk) on the other coordinates; an all-zero key writes nothing."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.layers.mixers import DeltaNetMixer, l2_normalize
    from nlearn.memory.delta import delta_rule

    config = load_family_config("deltanet")
    config.model.memory.qk_activation = "relu"
    config_lib.validate(config)
    x = 10 * jax.random.normal(jax.random.key(0), (1, 64, config.model.d_model))
    k = DeltaNetMixer(config.model, rngs=nnx.Rngs(0)).project(x)[1]
    assert float(jnp.mean(k == 0.0)) > 0.2 and jnp.all(k >= 0.0)

    rng = np.random.default_rng(0)
    T, H, D = 1000, 2, 8
    q, v = (jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32) for _ in range(2))
    k = jnp.asarray(rng.normal(size=(1, T, H, D)), jnp.float32)
    k = k.at[:, 0].set(jnp.eye(D)[0]).at[:, 1:, :, 0].set(0.0)  # token 0 writes along e_0, no later key does
    k = l2_normalize(jax.nn.relu(k)).at[:, 7].set(0.0)  # token 7: every coordinate negative before ReLU
    beta = jnp.asarray(rng.uniform(0.5, 1.0, (1, T, H)), jnp.float32)
    _, first_chunk = delta_rule(q[:, :64], k[:, :64], v[:, :64], beta[:, :64], chunk_size=64)
    _, state = delta_rule(q, k, v, beta, chunk_size=64)  # [B, H, D_k, D_v]
    np.testing.assert_array_equal(state[0, :, 0], first_chunk[0, :, 0])  # 936 later writes left it as it was
    np.testing.assert_allclose(state[0, :, 0], beta[0, 0, :, None] * v[0, 0], rtol=1e-5, atol=1e-6)
    silu_like = k.at[:, 1:, :, 0].set(0.05)  # a small nonzero component, as SiLU's: the needle is written over
    _, worn = delta_rule(q, l2_normalize(silu_like), v, beta, chunk_size=64)
    assert float(jnp.abs(worn[0, :, 0] - state[0, :, 0]).max()) > 0.5 * float(jnp.abs(state[0, :, 0]).max())
    from_6 = [x[:, 6:] for x in (q, k, v, beta)]  # token 7 is the second of these
    _, skipped = delta_rule(*from_6, impl="recurrent")
    _, without = delta_rule(*(jnp.delete(x, 1, axis=1) for x in from_6), impl="recurrent")
    np.testing.assert_allclose(skipped, without, rtol=1e-6, atol=1e-7)


def test_delta_rule_beta_min_bounds_the_write_strength():
    """memory.beta_min lifts every write's beta into [beta_min, 1) (0, the default, is plain sigmoid);
    values outside [0, 1) are refused naming the key."""
    import jax
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.errors import UserError
    from nlearn.layers.mixers import DeltaNetMixer

    config = load_family_config("deltanet")
    x = 30 * jax.random.normal(jax.random.key(0), (1, 64, config.model.d_model))  # saturates the sigmoid
    (beta,) = DeltaNetMixer(config.model, rngs=nnx.Rngs(0)).gates(x)
    assert float(beta.min()) < 0.05
    config.model.memory.beta_min = 0.5
    config_lib.validate(config)
    (lifted,) = DeltaNetMixer(config.model, rngs=nnx.Rngs(0)).gates(x)
    assert float(lifted.min()) >= 0.5 and float(lifted.max()) <= 1.0
    assert jax.numpy.allclose(lifted, 0.5 + 0.5 * beta)
    config.model.memory.beta_min = 1.0
    with pytest.raises(UserError, match="model.memory.beta_min=1.0"):
        config_lib.validate(config)


def test_delta_rule_hard_gate_can_skip_a_token_exactly():
    """memory.beta_gate='hard_sigmoid' reaches beta = 0 exactly (sigmoid never does), and a token written
    with beta 0 leaves the delta rule's state as it was: the chunked op over a sequence whose odd tokens have
    beta 0 ends in the state of the even tokens alone. An unknown gate is refused naming the key."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.errors import UserError
    from nlearn.layers.mixers import DeltaNetMixer, l2_normalize
    from nlearn.memory.delta import delta_rule

    config = load_family_config("deltanet")
    x = 30 * jax.random.normal(jax.random.key(0), (1, 64, config.model.d_model))
    (soft,) = DeltaNetMixer(config.model, rngs=nnx.Rngs(0)).gates(x)
    assert float(soft.min()) > 0.0
    config.model.memory.beta_gate = "hard_sigmoid"
    config_lib.validate(config)
    (hard,) = DeltaNetMixer(config.model, rngs=nnx.Rngs(0)).gates(x)
    assert float(hard.min()) == 0.0 and float(jnp.mean(hard == 0.0)) > 0.2

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 2, 8)), jnp.float32) for _ in range(3))
    k = l2_normalize(k)
    beta = jnp.asarray(rng.uniform(0.2, 1.0, (1, 40, 2)), jnp.float32).at[:, 1::2].set(0.0)
    _, state = delta_rule(q, k, v, beta, chunk_size=16)  # 40 tokens: chunks of 16, 16 and 8
    _, evens = delta_rule(q[:, ::2], k[:, ::2], v[:, ::2], beta[:, ::2], impl="recurrent")
    np.testing.assert_allclose(state, evens, rtol=1e-5, atol=1e-6)
    config.model.memory.beta_gate = "relu"
    with pytest.raises(UserError, match="model.memory.beta_gate='relu'"):
        config_lib.validate(config)


@pytest.mark.parametrize("family", ["deltanet", "gated_deltanet", "titans_lmm", "ttt_linear",
                                    pytest.param("ttt_mlp", marks=pytest.mark.slow)])  # ttt_mlp: ttt_linear's gates
def test_gate_conv_gives_the_gates_the_last_tokens(family):
    """memory.gate_conv=True: the gates read `sum_i w_i x_{t-K+1+i}` (checked against the same mixer without
    it fed that sum written out), so changing token j changes the gates at j..j+K-1 and no others (without it,
    at j alone); streaming the mixer in pieces (a prefill, two single tokens, the rest; 21 tokens, chunks of 8)
    equals one pass."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.models import FAMILIES

    config = load_family_config(family)
    config.model.update(d_model=32, num_heads=2)
    config.model.memory.chunk_size = 8
    if "minibatch" in config.model.memory:
        config.model.memory.minibatch = 4
    x = jax.random.normal(jax.random.key(1), (2, 21, 32))
    j, kernel = 5, config.model.memory.conv_size
    make = lambda: FAMILIES[family].make_mixer(config.model, 0, nnx.Rngs(0))  # noqa: E731

    def gates(mixer, x):
        return [g for g in mixer.project(x)[3] if g is not None]

    def changed_positions(mixer):
        before, after = gates(mixer, x), gates(mixer, x.at[:, j].add(1.0))
        moved = sum(jnp.max(jnp.abs(a - b), axis=(0, 2)) for a, b in zip(after, before))  # [T]
        moved = np.asarray(moved)
        return np.nonzero(moved > 1e-5 * moved.max())[0].tolist()

    plain = make()
    assert changed_positions(plain) == [j]
    config.model.memory.gate_conv = True
    config_lib.validate(config)
    mixer = make()
    assert changed_positions(mixer) == list(range(j, j + kernel))

    # Older taps start near 0 (the identity init); make them count, so a lost conv cache shows in the output.
    mixer.gate_conv.weight[...] = jax.random.normal(jax.random.key(2), mixer.gate_conv.weight.shape)
    w = np.asarray(mixer.gate_conv.weight[...])  # [K, d_model], oldest tap first
    padded = np.concatenate([np.zeros((2, kernel - 1, 32)), np.asarray(x)], axis=1)
    mixed = jnp.asarray(sum(padded[:, i:i + 21] * w[i] for i in range(kernel)), jnp.float32)
    for got, want in zip(gates(mixer, x), gates(plain, mixed)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    full, _ = mixer(x)
    cache, pieces = mixer.init_cache(2, 21), []
    for start, stop in ((0, 13), (13, 14), (14, 15), (15, 21)):
        out, cache = mixer(x[:, start:stop], cache)
        pieces.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full), atol=1e-5)


def test_decay_init_sets_the_forgetting_gates_start():
    """memory.decay_init is alpha at initialisation (the gate's bias is its logit); the default is
    the former hard-coded sigmoid(-4); values outside (0, 1) are refused naming the key."""
    import jax
    from flax import nnx

    from nlearn import config as config_lib
    from nlearn.errors import UserError
    from nlearn.layers.mixers import NeuralMemoryMixer

    config = load_family_config("titans_lmm")
    model = config.model
    assert float(NeuralMemoryMixer(model, rngs=nnx.Rngs(0)).decay_gate.bias[0]) == -4.0
    model.memory.decay_init = 1e-3
    bias = NeuralMemoryMixer(model, rngs=nnx.Rngs(0)).decay_gate.bias[...]
    assert jax.nn.sigmoid(bias) == pytest.approx(1e-3, rel=1e-5)
    config_lib.validate(config)
    for bad in (0.0, 1.0, -0.5):
        model.memory.decay_init = bad
        with pytest.raises(UserError, match="model.memory.decay_init"):
            config_lib.validate(config)


# Which learned gates each inner optimizer's layer builds (written out, not read from the registry):
# only optimizers with a momentum buffer get a momentum gate; dgd is eq. 88, which has none.
GATES_BY_OPTIMIZER = {
    "momentum": {"lr_gate", "momentum_gate", "decay_gate"},
    "sgd": {"lr_gate", "decay_gate"},
    "dgd": {"lr_gate", "decay_gate"},
    "dgd_momentum": {"lr_gate", "momentum_gate", "decay_gate"},
}


@pytest.mark.parametrize("momentum", [True, False])
def test_layer_builds_the_gates_of_its_optimizer(momentum):
    """Every registered optimizer builds exactly its gates, whatever `memory.momentum` says; a
    forward pass with the dgd layer runs on them."""
    import jax.numpy as jnp
    from flax import nnx

    from nlearn.layers.mixers import NeuralMemoryMixer
    from nlearn.memory.inner_optimizers import INNER_OPTIMIZERS

    assert set(GATES_BY_OPTIMIZER) == set(INNER_OPTIMIZERS)
    model = load_family_config("titans_lmm").model
    model.memory.momentum = momentum
    for name, gates in GATES_BY_OPTIMIZER.items():
        model.memory.optimizer = name
        mixer = NeuralMemoryMixer(model, rngs=nnx.Rngs(0))
        built = {key for key in nnx.state(mixer, nnx.Param) if key.endswith("_gate")}
        assert built == (gates if momentum else gates - {"momentum_gate"}), name
    model.memory.optimizer = "dgd"
    mixer = NeuralMemoryMixer(model, rngs=nnx.Rngs(0))
    y, _ = mixer(jnp.ones((1, 5, model.d_model)))
    assert y.shape == (1, 5, model.d_model) and bool(jnp.all(jnp.isfinite(y)))
