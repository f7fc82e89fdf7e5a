"""Family `hope`: the two-pass CMS step against a plain chunk-by-chunk reference, the outer gradient
with Δ a constant, causality, decoding that learns, config validation and preset sizes."""

import contextlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.experimental.compilation_cache import compilation_cache

import hope as hope_config
import transformer as transformer_config
from nlearn import models
from nlearn.config import validate
from nlearn.errors import UserError
from test_model import jitted

VOCAB, C = 61, 4  # C: the shortest period (the pass-1 chunk)


def small(mixer="attention", **cms):
    config = hope_config.get_config("tiny")
    with config.unlocked():
        config.data.vocab_size = VOCAB
        config.model.update(dict(d_model=32, num_layers=2, num_heads=2))
        config.model.cms.update(dict(periods=(C, 2 * C), lr=(0.5, 0.3), decay=(0.1, 0.2)), **cms)
        config.model.hope.mixer = mixer
    return config


@pytest.fixture(scope="module")
def model():
    return models.build(small())


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(0), (2, 19), 0, VOCAB)  # 19: a partial last chunk


def mean_ntp(logits, tokens):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]))


def sequential_reference(model, tokens):
    """Walk the window chunk by chunk through the decoding path; each chunk's summed NTP loss is
    differentiated w.r.t. Δ with `jax.grad`; a level steps `Δ -= lr Σ∇` when its period divides
    the tokens seen. Returns the Δ each chunk used and the logits."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def chunk(state, x, y, caches, delta):
        def loss(d):
            logits, new = nnx.merge(graphdef, state).run(x, caches, d)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :y.shape[1]], y)
            return jnp.sum(ce), (logits, new)

        return jax.grad(loss, has_aux=True)(delta)

    b, t = tokens.shape
    caches, delta = model.init_mixer_caches(b, t), model.zero_delta(b)
    gsum = model.zero_delta(b)
    used, logits = [], []
    for start in range(0, t, C):
        used.append(delta)
        x, y = tokens[:, start:start + C], tokens[:, start + 1:start + C + 1]
        grads, (lg, caches) = chunk(state, x, y, caches, delta)
        logits.append(lg)
        pos = start + x.shape[1]
        delta, gsum = [list(d) for d in delta], [list(s) for s in jax.tree.map(jnp.add, gsum, grads)]
        for i, block in enumerate(model.blocks):
            for j, (period, lr, decay) in enumerate(zip(block.cms.periods, block.cms.lrs, block.cms.decays)):
                if pos % period == 0:  # Δ ← (1 − decay) Δ − lr Σ∇: the retention toward θ_ℓ,0
                    delta[i][j] = jax.tree.map(lambda d, s: (1.0 - decay) * d - lr * s, delta[i][j], gsum[i][j])
                    gsum[i][j] = jax.tree.map(jnp.zeros_like, gsum[i][j])
    return used, jnp.concatenate(logits, axis=1)


def assert_two_pass_equals_reference(model, tokens):
    """Δ of every chunk and the loss of the two-pass forward against `sequential_reference` (≤ 1e-5
    relative, float32). Returns pass 1's Δ."""
    used, ref_logits = sequential_reference(model, tokens)
    adapted = jitted(model, "adapt")(tokens)
    for i, ref in enumerate(used):
        for got, want in zip(jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], adapted)), jax.tree.leaves(ref)):
            scale = max(float(jnp.abs(want).max()), 1e-30)
            assert float(jnp.abs(got - want).max()) <= 1e-5 * scale, f"chunk {i}"
    loss, ref_loss = mean_ntp(jitted(model)(tokens), tokens), mean_ntp(ref_logits, tokens)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    return adapted, len(used)


def test_two_pass_step_equals_the_sequential_reference(model, tokens):
    """The slow level moves only at its boundaries (tokens 8 and 16), the fast one at every chunk."""
    adapted, n = assert_two_pass_equals_reference(model, tokens)
    slow = np.asarray(adapted[0][1]["gate"])  # block 0, level of period 2C
    fast = np.asarray(adapted[0][0]["gate"])
    for i in range(1, n):
        assert (not np.array_equal(slow[i], slow[i - 1])) == (i * C % (2 * C) == 0), i
        assert not np.array_equal(fast[i], fast[i - 1]), i


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])  # scanned: `make test-all`
def test_parallel_pass_from_factors_equals_fixed_deltas(tokens, scan):
    """The training forward (pass 1's per-token factors, each period's Δ rebuilt inside the layer) equals the
    parallel pass with the per-chunk Δ of `adapt` held fixed, with scan steps of 1 and 2 chunks and levels
    whose periods are 1, 2 and 4 chunks."""
    config = small(periods=(C, 2 * C, 4 * C), lr=(0.5, 0.3, 0.2), decay=(0.1,))
    with config.unlocked():
        config.model.scan_layers = scan
    model = models.build(config)
    graphdef, state = nnx.split(model)
    fixed = jax.jit(lambda s, x: nnx.merge(graphdef, s).run(
        x, deltas=model.per_period(nnx.merge(graphdef, s).adapt(x)), segmented=True)[0])
    want = fixed(state, tokens)
    for phases in (1, 2):
        model.phases = phases
        got = jitted(model)(tokens)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the self-referential op's pass 1 compiles for minutes on 2 cores
def test_two_pass_step_with_the_self_referential_mixer():
    """Hope's own mixer, whose state depends on the place in its period (8 tokens: two chunks per
    pass-1 scan step, the last step half past the window); the op's chunks (2 and 8 tokens) cut the
    CMS chunks. The reference feeds the stream positions as traced values, pass 1 as static ones."""
    config = small("self_referential")
    with config.unlocked():
        config.model.memory.update(chunk_memory=2, chunk_other=2 * C)
    model = models.build(config)
    assert model.phases == 2
    assert_two_pass_equals_reference(model, jax.random.randint(jax.random.key(3), (2, 23), 0, VOCAB))


def test_outer_gradient_treats_delta_as_a_constant(model, tokens):
    graphdef, state = nnx.split(model)
    fixed = jitted(model, "adapt")(tokens)

    def two_pass(state):
        return mean_ntp(nnx.merge(graphdef, state)(tokens), tokens)

    def constant_delta(state):
        m = nnx.merge(graphdef, state)
        return mean_ntp(m.run(tokens, deltas=m.per_period(fixed), segmented=True)[0], tokens)

    got, want = jax.jit(jax.grad(two_pass))(state), jax.jit(jax.grad(constant_delta))(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-7)
    theta0 = got["blocks"][1]["cms"]["levels"][1]["mlp"]["up"]["kernel"][...]
    assert float(jnp.abs(theta0).sum()) > 0


def _remat_losses(tokens, scan: bool):
    """The mean next-token loss of `small()` without and with `model.remat`, as functions of the state."""
    out = []
    for remat in (False, True):
        config = small()
        with config.unlocked():
            config.model.update(remat=remat, scan_layers=scan)
        graphdef, state = nnx.split(models.build(config))
        out.append((lambda s, g=graphdef: mean_ntp(nnx.merge(g, s)(tokens), tokens), state))
    return out


@pytest.mark.parametrize("scan", [False, True])
def test_remat_rematerialises_the_blocks(tokens, scan):
    """`model.remat` applies to Hope's training forward (each block a jax.checkpoint, primitive remat2)."""
    for (loss, state), remat in zip(_remat_losses(tokens, scan), (False, True)):
        assert ("remat" in str(jax.make_jaxpr(loss)(state))) == remat


@pytest.mark.slow  # four compiles of Hope's gradient: ~3 minutes on 2 cores
@pytest.mark.parametrize("scan", [False, True])
def test_remat_keeps_the_gradient(tokens, scan):
    (plain, state), (remat, _) = _remat_losses(tokens, scan)
    want, got = jax.jit(jax.grad(plain))(state), jax.jit(jax.grad(remat))(state)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-7)


def test_causal_end_to_end(model, tokens):
    fwd = jitted(model)
    logits, p = fwd(tokens), 9  # inside the third chunk: the Δ from tokens < 9 must not move
    changed = tokens.at[:, p:].set((tokens[:, p:] + 5) % VOCAB)
    after = fwd(changed)
    np.testing.assert_allclose(np.asarray(after[:, :p]), np.asarray(logits[:, :p]), atol=1e-6)
    assert not np.allclose(np.asarray(after[:, p:]), np.asarray(logits[:, p:]))


def decoded(model, tokens, prompt: int = 6):
    """The logits of decoding a `prompt`-token prompt, then one token at a time, and the final cache."""
    decode = jitted(model, "decode")
    t = tokens.shape[1]
    logits, cache = decode(tokens[:, :prompt], model.init_cache(tokens.shape[0], t))
    steps = [logits]
    for i in range(prompt, t):
        logits, cache = decode(tokens[:, i:i + 1], cache)
        steps.append(logits)
    return jnp.concatenate(steps, 1), cache


@pytest.mark.parametrize("prompt", [6, 8])
def test_decoding_with_updates_equals_the_full_forward(model, tokens, prompt):
    """A prompt, then one token at a time: the levels learn on what was seen. A prompt of 8 is two whole
    `decode_span`s, read a CMS chunk per step."""
    logits, cache = decoded(model, tokens, prompt)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(jitted(model)(tokens)), atol=1e-5)
    assert int(cache["pos"]) == 19


@pytest.mark.parametrize("scan", [False, pytest.param(True, marks=pytest.mark.slow)])  # scanned: `make test-all`
def test_learned_rates_start_as_the_fixed_ones_and_learn_through_the_rebuild(tokens, scan):
    """`cms.learn_lr=True`: at initialisation the forward is the fixed rates' forward; with each layer's rates
    moved apart, decoding equals the full forward, and the outer gradient w.r.t. `log_lr` is the derivative of
    the loss with pass 1's factors held fixed (a central difference checks it)."""
    configs = [small(learn_lr=True), small()]
    for config in configs:
        with config.unlocked():
            config.model.scan_layers = scan
    learned, fixed = map(models.build, configs)
    nnx.update(fixed, nnx.filter_state(nnx.state(learned, nnx.Param), lambda path, _: "log_lr" not in path))
    np.testing.assert_allclose(np.asarray(jitted(learned)(tokens)), np.asarray(jitted(fixed)(tokens)), rtol=1e-5,
                               atol=1e-6)
    log_lr = learned.layers.cms.log_lr if scan else learned.blocks[1].cms.log_lr
    log_lr[...] = log_lr[...] + jnp.asarray([0.7, -0.4])  # scanned: every layer; else the second one only
    full = np.asarray(jitted(learned)(tokens))
    np.testing.assert_allclose(np.asarray(decoded(learned, tokens)[0]), full, atol=1e-5)
    assert not np.allclose(full, np.asarray(jitted(fixed)(tokens)), atol=1e-4)

    graphdef, state = nnx.split(learned)
    factors = jax.jit(lambda s: nnx.merge(graphdef, s).first_pass(tokens))(state)
    loss_with_factors = jax.jit(lambda s: mean_ntp(nnx.merge(graphdef, s).run(tokens, factors=factors)[0], tokens))
    grads = jax.jit(jax.grad(lambda s: mean_ntp(nnx.merge(graphdef, s)(tokens), tokens)))(state)
    g_model = nnx.merge(graphdef, grads)
    got = np.asarray((g_model.layers.cms.log_lr if scan else g_model.blocks[1].cms.log_lr)[...]).reshape(-1)
    base, eps = log_lr[...], 2e-2  # float32 losses: a wider step keeps the difference above rounding

    def loss_at(flat_index, step):
        log_lr[...] = base.reshape(-1).at[flat_index].add(step).reshape(base.shape)
        return float(loss_with_factors(nnx.split(learned)[1]))

    want = np.asarray([(loss_at(i, eps) - loss_at(i, -eps)) / (2 * eps) for i in range(got.size)])
    log_lr[...] = base
    assert np.abs(got).max() > 0
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_updates_change_the_logits_and_none_is_static(model, tokens):
    static = models.build(small(update="none"))
    nnx.update(static, nnx.state(model, nnx.Param))
    a, b = np.asarray(jitted(model)(tokens)), np.asarray(jitted(static)(tokens))
    np.testing.assert_allclose(a[:, :C], b[:, :C], atol=1e-6)  # the first chunk reads θ0
    assert not np.allclose(a[:, C:], b[:, C:], atol=1e-4)


@pytest.mark.parametrize("key,value,needle", [
    ("periods", (4, 6), "model.cms.periods"),
    ("periods", (), "model.cms.periods"),
    ("lr", (0.1,), "model.cms.lr"),
    ("widths", (8, 0), "model.cms.widths"),
    ("order", "sideways", "model.cms.order"),
    ("update", "sgd", "model.cms.update"),
    ("decay", (1.0,), "model.cms.decay"),
    ("decay", (0.1, 0.1, 0.1), "model.cms.decay"),
])
def test_bad_cms_values_are_refused_in_one_line(key, value, needle):
    config = small()
    with config.unlocked():
        config.model.cms[key] = value
    with pytest.raises(UserError, match=needle) as err:
        validate(config)
    assert "\n" not in str(err.value)


def test_learned_rates_refuse_a_zero_rate():
    config = small(learn_lr=True, lr=(0.5, 0.0))
    with pytest.raises(UserError, match="model.cms.lr=.*learned as its logarithm"):
        validate(config)


def test_bad_mixer_is_refused():
    config = small()
    with config.unlocked():
        config.model.hope.mixer = "rnn"
    with pytest.raises(UserError, match="model.hope.mixer"):
        validate(config)


def test_tiny_matches_the_tiny_transformer():
    n, ref = models.count_params(hope_config.get_config("tiny")), models.count_params(transformer_config.get_config())
    assert abs(n - ref) / ref <= 0.05, (n, ref)


@contextlib.contextmanager
def persistent_compilation_cache(path):
    """JAX's on-disk compilation cache in `path` while the block runs: a second run of the same program
    loads its executable instead of compiling it again."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes")
    old = {k: getattr(jax.config, k) for k in keys}
    for key, value in zip(keys, (str(path), 0, 0)):
        jax.config.update(key, value)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for key, value in old.items():
            jax.config.update(key, value)
        compilation_cache.reset_cache()


def test_the_preset_hope_trains_resumes_and_decodes(tmp_path, cache_dir, text_corpus, capsys):
    """Hope as its preset builds it (its self-referential mixer, CMS levels learning by next-token loss), at toy
    sizes: the trainer's steps, a run resumed from its step-1 checkpoint logs the uninterrupted run's step-2
    loss, and decoding in two calls gives the full forward's logits."""
    from nlearn.train import train_and_evaluate

    config = hope_config.get_config("tiny")
    assert config.model.hope.mixer == "self_referential" and config.model.cms["update"] == "ntp"
    with config.unlocked():
        config.model.update(dict(d_model=16, num_layers=1, num_heads=1))
        config.model.cms.update(dict(periods=(2, 4), lr=(0.5, 0.3), decay=(0.01, 0.01)))
        config.model.memory.update(chunk_memory=2, chunk_other=4)
        config.data.update(source="text", path=text_corpus, cache_dir=cache_dir, vocab_size=300, eval_tokens=512)
        config.train.update(steps=2, batch_size=2, seq_len=8, warmup_steps=1, log_every=1, peak_gflops=100.0,
                            final_eval=False)
        config.checkpoint.update(every_steps=1, async_save=False)
        config.logging.update(wandb_mode="disabled", plot=False, progress=False)
    validate(config)
    run = tmp_path / "run"
    with persistent_compilation_cache(tmp_path / "xla"):
        train_and_evaluate(config, str(run))
        straight = [json.loads(line) for line in open(run / "metrics.jsonl")]
        shutil.rmtree(run / "checkpoints" / "2")
        capsys.readouterr()
        assert train_and_evaluate(config, str(run))["step"] == 2
    assert "resuming from checkpoint at step 1" in capsys.readouterr().out
    resumed = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in straight] == [r["step"] for r in resumed] == [1, 2]
    assert resumed[1]["loss"] == straight[1]["loss"] and np.isfinite(straight[1]["loss"])

    model = models.build(config)
    tokens = jax.random.randint(jax.random.key(5), (2, 16), 0, 300)  # four periods of the slow level
    full = np.asarray(jitted(model)(tokens))
    assert model.decode_span == 4  # a CMS chunk of 2 per step over whole mixer periods of 4
    decode, cache, pieces = jitted(model, "decode"), model.init_cache(2, 16), []
    for start, stop in ((0, 4), (4, 8), (8, 9), (9, 13), (13, 16)):  # aligned spans, a token, an unaligned span
        logits, cache = decode(tokens[:, start:stop], cache)
        pieces.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), full, atol=1e-5)
    by_chunks, _ = jitted(model, "_decode_chunks")(tokens[:, :8], model.init_cache(2, 16))
    np.testing.assert_allclose(np.asarray(by_chunks), full[:, :8], atol=1e-5)  # the chunk path itself
