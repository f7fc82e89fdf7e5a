"""`model.scan_layers=True`: the blocks stacked on a `layers` axis and run by one scan give the unscanned
model's parameters (same seed), loss, gradients and decoding, for every family (Hope's two-pass CMS step
included); a scanned run resumes from its checkpoint; bad values are refused in one line."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nlearn import models
from nlearn.config import validate
from nlearn.errors import UserError
from nlearn.models.lm import STACKED, stack_blocks, unstack_blocks
from nlearn.train.optim import decay_mask
from nlearn.train.step import token_losses
from test_families import tiny  # vocabulary 61, d_model 32, 2 layers, chunk_size 8

SCANNABLE = sorted(models.FAMILIES)
FAST = ("transformer",)  # in the default suite, with a remat variant; the rest is slow


def config_of(family, **model):
    """`tiny(family)`; Hope with periods of 4 and 8 tokens, so that both CMS levels learn inside the
    20-token window, and its attention mixer (`hope_self_referential` for its own)."""
    if not family.startswith("hope"):
        return tiny(family, **model)
    config = tiny("hope", **model)
    with config.unlocked():
        config.model.cms.update(dict(periods=(4, 8), lr=(0.5, 0.3), decay=(0.01,)))
        if family == "hope":
            config.model.hope.mixer = "attention"
        else:  # the op's chunks (2 and 8 tokens) cut the CMS chunks; pass 1 passes the stream position along
            config.model.memory.update(chunk_memory=2, chunk_other=8)
    return config


def _params(model):
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, nnx.to_pure_dict(params)


def _loss_and_grads(graphdef, params, tokens_BT):
    def loss(p):
        return jnp.mean(token_losses(graphdef, p, tokens_BT[:, :-1], tokens_BT[:, 1:], jnp.float32))

    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_trees_close(got, want, rtol=1e-5):
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
    assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)] == paths
    for path, g, w in zip(paths, jax.tree.leaves(got), jax.tree.leaves(want)):
        w = np.asarray(w)
        np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=rtol * float(np.max(np.abs(w)) + 1e-30),
                                   err_msg=path)


def _check_equal_to_unscanned(family, *variants):
    """Each variant (model overrides) of the scanned model against the unscanned one from the same seed:
    the same draws (the scanned init is one scan over layers; built eagerly, the samplers round apart by
    an ulp), then the loss and gradients from the unscanned parameters, stacked."""
    plain = models.build(config_of(family))
    tokens = jax.random.randint(jax.random.key(0), (2, 21), 0, 61)
    loss_p, grads_p = _loss_and_grads(*_params(plain), tokens)
    assert all(bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads_p["blocks"][0]))  # every block param learns
    stacked = stack_blocks(_params(plain)[1])
    jax.tree.map(np.testing.assert_array_equal, unstack_blocks(stacked), _params(plain)[1])
    for model in variants:
        scanned = models.build(config_of(family, scan_layers=True, **model))
        assert not hasattr(scanned, "blocks") and not hasattr(plain, STACKED)
        graphdef, params = _params(scanned)
        _assert_trees_close(params, stacked, rtol=1e-6)  # same seed, same values
        loss_s, grads_s = _loss_and_grads(graphdef, stacked, tokens)
        np.testing.assert_allclose(float(loss_s), float(loss_p), rtol=1e-6, err_msg=str(model))
        _assert_trees_close(grads_s, stack_blocks(grads_p))


@pytest.mark.parametrize("family", FAST)
def test_scanned_loss_and_gradients_equal_unscanned(family):
    """Plain, and with each block rematerialised keeping its matmul outputs."""
    _check_equal_to_unscanned(family, {}, dict(remat=True, remat_policy="dots_saveable"))


@pytest.mark.slow
def test_every_other_familys_scanned_loss_and_gradients_equal_unscanned(subtests):
    """One subtest per family. Hope: pass 1 scans the layers inside its scan over chunks, and each layer's Δ
    rides the layers axis."""
    for family in [f for f in SCANNABLE + ["hope_self_referential"] if f not in FAST]:
        with subtests.test(family=family):
            _check_equal_to_unscanned(family, {})


@pytest.mark.slow
@pytest.mark.parametrize("family, policy", [("linear_attention", "dots_saveable"), ("transformer", "full")])
def test_scanned_remat_keeps_the_gradients(family, policy):
    """Each scanned block rematerialised under `policy`: the unscanned model's gradients still."""
    _check_equal_to_unscanned(family, dict(remat=True, remat_policy=policy))


def test_scanned_decoding_matches_the_scanned_forward():
    """The cache is one pytree stacked on the layers axis; prompt then one token at a time, through the
    scan over layers, gives the full forward."""
    _check_scanned_decoding("linear_attention")


@pytest.mark.slow
def test_every_other_familys_scanned_decoding_matches_the_scanned_forward(subtests):
    for family in [f for f in SCANNABLE if f != "linear_attention"]:
        with subtests.test(family=family):
            _check_scanned_decoding(family)


def _check_scanned_decoding(family):
    model = models.build(config_of(family, scan_layers=True))
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    decode = jax.jit(lambda s, t, c: nnx.merge(graphdef, s).decode(t, c))
    tokens = jax.random.randint(jax.random.key(1), (2, 19), 0, 61)
    cache = model.init_cache(2, 19)
    layered = cache["mix"] if family == "hope" else cache  # hope: and its Δ, sums, current chunk, position
    assert all(leaf.shape[0] == 2 for leaf in jax.tree.leaves(layered))  # [layers, ...]
    logits, cache = decode(state, tokens[:, :7], cache)
    steps = [logits]
    for i in range(7, 19):
        logits, cache = decode(state, tokens[:, i:i + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(forward(state, tokens)), atol=1e-4)


def _lowered_init(config):
    """The jitted init of the train state's parameters (what `Setup.init_state` compiles), lowered."""
    from nlearn.train.optim import make_optimizer
    from nlearn.train.state import _init_state

    optimizer = make_optimizer(config)
    return jax.jit(lambda: _init_state(config, optimizer)["params"]).lower()


def test_scanned_train_step_and_init_do_not_grow_with_depth():
    """The lowered train step and state init hold one block whatever the depth (the unrolled ones grow with
    it): compile time flat in depth, measured without timing."""
    from nlearn.train.state import make_setup
    from nlearn.train.step import make_train_step

    def lowered(layers, scan):
        config = tiny("transformer", num_layers=layers, scan_layers=scan)
        setup = make_setup(config)
        step = make_train_step(setup.config, setup.graphdef, setup.optimizer, dtype=jnp.float32)
        batch = {k: jax.ShapeDtypeStruct((2, 16), jnp.int32) for k in ("inputs", "targets")}
        return jax.jit(step).lower(setup.abstract_state, batch), _lowered_init(config)

    def lines(lowered):
        return len(lowered.as_text().splitlines())

    (step2, init2), (step4, init4) = lowered(2, True), lowered(4, True)
    (plain_step2, plain_init2), (plain_step4, plain_init4) = lowered(2, False), lowered(4, False)
    assert lines(step2) == lines(step4) and lines(init2) == lines(init4)
    assert lines(plain_step4) > lines(plain_step2) + 1000  # what the measure would show if the scan unrolled
    assert lines(plain_init4) > lines(plain_init2) + 100


@pytest.mark.slow
def test_scanned_jitted_init_equals_unscanned_exactly():
    """The trainer's jitted init (one scan over layers) draws the unscanned model's parameters bit for bit."""
    scanned, plain = (_lowered_init(tiny("titans_lmm", scan_layers=scan)).compile()() for scan in (True, False))
    jax.tree.map(np.testing.assert_array_equal, scanned, stack_blocks(plain))


def test_stacked_layout_keeps_decay_and_places_the_layers_axis_replicated():
    """Weight decay picks the same parameters in both layouts (a stacked 1-D gate stays undecayed), and
    the stacked axis carries the logical name `layers`, replicated by the default rules."""
    from nlearn.train.state import make_setup

    config = tiny("titans_lmm", scan_layers=True)
    plain = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: models.build(tiny("titans_lmm"))), nnx.Param))
    scanned = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: models.build(config)), nnx.Param))
    mask = decay_mask(plain)
    assert decay_mask(scanned)[STACKED] == mask["blocks"][0] == mask["blocks"][1]
    assert jax.tree.leaves(mask["blocks"][0]).count(False) >= 4  # norms and gates exist to get this wrong
    shardings = make_setup(config).state_shardings["params"][STACKED]
    kernel = shardings["mlp"]["up"]["kernel"].spec
    assert len(kernel) == 3 and kernel[0] is None
    specs = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(nnx.eval_shape(lambda: models.build(config)),
                                                               nnx.Param)))
    assert specs[STACKED]["mlp"]["up"]["kernel"] == jax.sharding.PartitionSpec("layers", "embed", "mlp")


@pytest.mark.parametrize("key, value, message", [
    ("remat_policy", "most", "model.remat_policy='most': valid choices: full, dots_saveable"),
    ("remat_policy", "dots_saveable", "set model.remat=True too"),
])
def test_bad_values_are_refused_in_one_line(key, value, message):
    config = tiny("transformer")
    with config.unlocked():
        config.model[key] = value
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
        validate(config)
    assert "\n" not in str(e.value)


def test_layers_that_differ_by_index_are_refused_in_one_line():
    """The scanned init builds one block for all layers: a mixer factory that branches on the index cannot."""
    from nlearn.models.lm import LanguageModel
    from nlearn.models.transformer import make_attention

    def every_other(cfg, layer_index, rngs):
        return make_attention(cfg, layer_index, rngs) if layer_index % 2 == 0 else None

    with pytest.raises(UserError, match="layers of family 'transformer' differ by index") as e:
        LanguageModel(tiny("transformer", scan_layers=True).model, every_other, rngs=nnx.Rngs(params=0))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["transformer", "hope"])
def test_scanned_run_resumes_exactly(family, tmp_path, cache_dir, text_corpus, capsys):
    """A scanned run checkpointed at step 2 of 4 resumes there and ends where the uninterrupted run did."""
    from nlearn.train import train_and_evaluate

    config = config_of(family, scan_layers=True)
    with config.unlocked():
        config.data.update(source="text", path=text_corpus, cache_dir=cache_dir, vocab_size=300, eval_tokens=512)
        config.train.update(steps=4, batch_size=2, seq_len=16, warmup_steps=1, log_every=2, peak_gflops=100.0)
        config.checkpoint.update(every_steps=2, async_save=False)
        config.logging.update(wandb_mode="disabled", plot=False, progress=False)
    validate(config)
    straight = train_and_evaluate(config, str(tmp_path))
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    os.remove(tmp_path / "eval.json")
    capsys.readouterr()
    resumed = train_and_evaluate(config, str(tmp_path))
    assert "resuming from checkpoint at step 2" in capsys.readouterr().out
    assert resumed["step"] == straight["step"] == 4
    assert abs(resumed["loss"] - straight["loss"]) <= 1e-6 * straight["loss"]
