"""Family `self_ref_titans`: preset sizes, refused config values, every `model.memory` key as a
one-line override, the mixer's decoding (constant-size cache) equal to its forward across chunk
boundaries of both grids, gradients reaching every meta-learned parameter, and train + generate
through the CLIs. The op itself is tested in tests/memory/test_self_referential.py."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

import self_ref_titans
from nlearn import models
from nlearn.config import validate
from nlearn.errors import UserError
from nlearn.layers.self_referential import SelfReferentialMixer
from nlearn.memory.self_referential import memory_names
from run_helpers import ROOT, run_cli, tiny_overrides
from test_cli import assert_one_line_failure


# LLVM -O0 compiles these small programs ~3x sooner and leaves the float math alone.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def run_fast(fn, *args):
    return jax.jit(fn).lower(*args).compile(FAST_COMPILE)(*args)


def small(**memory):
    """One layer, d_model 32, 2 heads of 16; chunks of 4 (memory) and 8 (the generators)."""
    config = self_ref_titans.get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = 61
        config.model.update(dict(d_model=32, num_layers=1, num_heads=2))
        config.model.memory.update(dict(chunk_memory=4, chunk_other=8), **memory)
    return config


def parsed(*overrides):
    """`configs/self_ref_titans.py:tiny` with `--config.model.memory.*` overrides, parsed as the CLI does."""
    argv = ["test", f"--config={ROOT}/configs/self_ref_titans.py:tiny",
            *(f"--config.model.memory.{o}" for o in overrides)]
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", None, "", flag_values=values, lock_config=True, sys_argv=argv)
    values(argv)
    return values.config


# Counted without allocating; a change here changes the presets' documented sizes.
COUNTS = {"tiny": 5_255_712, "340m": 349_023_104, "760m": 759_463_936, "1.3b": 1_311_462_528}


@pytest.mark.parametrize("preset", ["tiny"] + [pytest.param(p, marks=pytest.mark.slow)
                                               for p in ("340m", "760m", "1.3b")])
def test_presets_have_their_pinned_sizes(preset):
    n = models.count_params(self_ref_titans.get_config(preset))
    assert n == COUNTS[preset]
    target = 5.31e6 if preset == "tiny" else float(preset.rstrip("mb")) * (1e9 if preset.endswith("b") else 1e6)
    assert abs(n - target) / target <= 0.15  # tiny: the tiny Transformer++'s 5.31M


@pytest.mark.parametrize("key,value,needle", [
    ("chunk_memory", 0, "integer >= 1"),
    ("chunk_other", 24, "divide"),  # neither 16 nor 24 divides the other
    ("read", "after", "before_write"),
    ("activation", "softplus", "gelu"),
    ("dgd", 1, "True or False"),
    ("dgd_output", 1, "True or False"),
    ("self_targets", 0, "True or False"),
    ("adaptive_q", 1, "True or False"),
    ("read_residual", 0, "True or False"),
    ("lr_max", 0.0, "(0, 1]"),
    ("lr_max", 1.5, "(0, 1]"),
    ("expansion", 0, "integer >= 1"),
    ("retain_init", 1.0, "(0, 1)"),
    ("lr_init", 0.0, "(0, 1)"),
    ("conv_size", -1, "integer >= 0"),
    ("targets", "moving", "chunk, initial"),
    ("inner_step", "nlms", "plain, normalized"),
    ("retain_to", "one", "zero, initial"),
    ("lr_gate", "relu", "none, sigmoid, hard_sigmoid"),
    ("gate_conv", 1, "True or False"),
    ("gate_conv", True, "set model.memory.lr_gate too"),  # lr_gate "none": no gate to feed
])
def test_bad_memory_values_are_refused_naming_the_key(key, value, needle):
    config = self_ref_titans.get_config("tiny")
    with config.unlocked():
        del config.model.memory[key]  # any type: a config file may set what an override cannot
        config.model.memory[key] = value
    with pytest.raises(UserError) as err:
        validate(config)
    line = str(err.value)
    assert "\n" not in line and f"model.memory.{key}=" in line and needle in line, line


@pytest.mark.slow
def test_a_bad_value_on_the_command_line_is_one_line(tmp_path, cache_dir, text_corpus):
    proc = run_cli("train", "--config=configs/self_ref_titans.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus), "--config.model.memory.read=eq86")
    assert_one_line_failure(proc, "model.memory.read", "after_write")


def _forward(config, x_BTD):
    mixer = SelfReferentialMixer(config.model, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(mixer)
    return mixer, run_fast(lambda s, x: nnx.merge(graphdef, s)(x)[0], state, x_BTD)


OVERRIDES = ["read=before_write", "read=chunk_start", "dgd=False", "dgd_output=True", "self_targets=False",
             "adaptive_q=True", "chunk_memory=8", "chunk_other=4", "lr_max=0.25", "expansion=2", "activation=silu",
             "retain_init=0.9", "lr_init=0.3", "conv_size=2", "conv_init=uniform", "targets=initial",
             "inner_step=normalized", "read_residual=False", "retain_to=initial"]


def test_a_memory_key_is_a_one_line_override():
    """Parsed as the CLI parses it, validated, reaches the layer, and changes its output."""
    _check_override(OVERRIDES[0])


@pytest.mark.slow
def test_every_other_memory_key_is_a_one_line_override(subtests):
    for override in OVERRIDES[1:]:
        with subtests.test(override=override):
            _check_override(override)


def _check_override(override):
    key, value = override.split("=")
    config = parsed(override)
    validate(config)
    assert str(config.model.memory[key]) == value
    base = parsed()
    for c in (config, base):
        with c.unlocked():
            c.model.update(d_model=32, num_heads=2)
            if key not in ("chunk_memory", "chunk_other"):
                c.model.memory.update(chunk_memory=4, chunk_other=8)
    x = jax.random.normal(jax.random.key(0), (2, 13, 32))
    mixer, y = _forward(config, x)
    _, y0 = _forward(base, x)
    assert bool(jnp.all(jnp.isfinite(y)))
    assert float(jnp.max(jnp.abs(y - y0))) > 1e-7, f"{override} changed nothing"
    if key == "adaptive_q":
        assert "q" in mixer.weights0() and mixer.weights0()["q"][1].shape == (2, 16, 16)


@pytest.mark.parametrize("memory", [dict(), pytest.param(dict(chunk_memory=8, chunk_other=4, read="chunk_start"),
                                                          marks=pytest.mark.slow),
                                    pytest.param(dict(read_residual=False), marks=pytest.mark.slow),
                                    dict(retain_to="initial"), dict(lr_gate="sigmoid", gate_conv=True)])
def test_decoding_equals_the_forward_with_a_constant_size_cache(memory):
    """A 5-token prompt, then one token at a time across chunk boundaries of both grids."""
    config = small(**memory)
    mixer = SelfReferentialMixer(config.model, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(mixer)
    fn = lambda s, x, c: nnx.merge(graphdef, s)(x, c)  # noqa: E731
    x = 0.5 * jax.random.normal(jax.random.key(1), (2, 19, 32))
    full, _ = run_fast(fn, state, x, None)
    cache = mixer.init_cache(2, 19)
    shapes = jax.tree.map(jnp.shape, cache)
    y, cache = run_fast(fn, state, x[:, :5], cache)
    step = jax.jit(fn).lower(state, x[:, :1], cache).compile(FAST_COMPILE)
    steps = [y]
    for i in range(5, 19):
        y, cache = step(state, x[:, i:i + 1], cache)
        steps.append(y)
        assert jax.tree.map(jnp.shape, cache) == shapes
    assert jax.tree.map(jnp.shape, mixer.init_cache(2, 4096)) == shapes
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_every_parameter_of_the_layer_gets_a_gradient():
    """The initial weights of every memory and both biases are learnt by the outer loop."""
    config = small(adaptive_q=True)
    mixer = SelfReferentialMixer(config.model, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(mixer)
    x = jax.random.normal(jax.random.key(2), (2, 21, 32))
    loss = lambda s: jnp.sum(nnx.merge(graphdef, s)(x)[0] ** 2)  # noqa: E731
    grads = run_fast(jax.grad(loss), state)
    flat = {"/".join(map(str, path)): g for path, g in nnx.to_flat_state(grads)}
    for group in ("w_in", "w_out"):
        for name in memory_names(adaptive_q=True):
            assert float(jnp.max(jnp.abs(flat[f"{group}/{name}"][...]))) > 0, f"{group}/{name}"
    for path, g in flat.items():
        assert float(jnp.max(jnp.abs(g[...]))) > 0, path


@pytest.mark.slow
def test_train_then_generate_from_the_checkpoint(tmp_path, cache_dir, text_corpus):
    """`nlearn-train` a few steps at a small shape, then `nlearn-generate` continues a prompt."""
    proc = run_cli("train", "--config=configs/self_ref_titans.py:tiny", f"--workdir={tmp_path}",
                   *tiny_overrides(cache_dir, text_corpus, **{"train.steps": 4, "train.seq_len": 24}))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.load(open(tmp_path / "eval.json"))
    assert result["step"] == 4 and np.isfinite(result["loss"])
    proc = run_cli("generate", f"--workdir={tmp_path}", "--prompt=It is a truth", "--max_new_tokens=8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("It is a truth")
