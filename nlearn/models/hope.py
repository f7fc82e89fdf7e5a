"""Family `hope` (docs/self_referential.md §2-3): a mixer (self-referential Titans, or causal attention for
Hope-Attention) followed by a Continuum Memory System whose levels keep learning in context.

    h = x + mixer(Norm(x));   for each CMS level ℓ: h = h + MLP_{θℓ,0 + Δℓ}(Norm_ℓ(h))

With `cms.update="ntp"` the forward takes the inputs `[B, T]` only and does both passes itself
(the next-token target of input t is input t+1, so the trainer stays as it is):
1. `adapt`: a scan over chunks of `min C_ℓ` tokens through the whole model with the decoding
   state; each chunk's summed next-token loss is differentiated w.r.t. `Δ` (the state carried in
   from earlier chunks a constant), the gradients are summed per level and applied at each level's
   boundary. The parameters enter under `stop_gradient`: `Δ` is a constant to the outer loss.
2. the ordinary parallel forward, every level using the `Δ` of its period (rebuilt from pass 1's per-token
   factors; with `cms.learn_lr` the rebuild's rates are parameters, so the outer loss reaches them through it).
The window's last chunk is never differentiated: its gradients would only reach later windows.
Decoding carries `Δ`, the running sums, the current chunk's tokens and the decoding state at its
start; when the token after a chunk arrives it supplies the last target, the chunk's gradient is
taken from that saved state, and the levels at a boundary update (constant memory per token).
"""

from __future__ import annotations

from functools import partial
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from nlearn.errors import UserError
from nlearn.layers.cms import (ORDERS, UPDATES, ContinuumMemory, accumulate_and_update, deltas_from_factors,
                                factor_grads)
from nlearn.layers.core import RMSNorm, swiglu_width
from nlearn.models.registry import register
from nlearn.models.lm import REMAT_POLICIES, LanguageModel, per_layer, scan_layers
from nlearn.models.self_referential import MIGRATIONS as SELF_REFERENTIAL_MIGRATIONS
from nlearn.models import flops

MIXERS = ("self_referential", "attention")


def _is_level_factors(x) -> bool:
    """A CMS level's factors (`nlearn.layers.cms`): the leaf of a map over levels."""
    return isinstance(x, dict) and "z" in x


def cms_config(**overrides) -> ml_collections.ConfigDict:
    """The `model.cms` section (docs/self_referential.md §2); one entry per level in `periods`, `lr`, `widths`."""
    c = ml_collections.ConfigDict()
    c.periods = (16, 64, 256)  # tokens between updates of each level (each a multiple of the smallest)
    c.lr = (1e-3, 1e-3, 1e-3)  # Δ ← (1 − decay) Δ − lr Σ∇ℓ_NTP over the level's last period (summed, not averaged)
    # Retention toward the meta-learned θ_ℓ,0 at each update, one per level (or one for all): a gradient that
    # never lets up then holds |Δ| below lr |∇| / decay (HOPE.md's Δ has none and drifts without bound over a
    # long stream); 0.01 forgets half of Δ in ~70 updates (1.1K tokens at period 16).
    c.decay = (0.01, 0.01, 0.01)
    c.learn_lr = False  # True: each level's lr is learned by the outer loop (per layer, starting at `lr`)
    c.widths = ()  # SwiGLU hidden width per level; (): the Transformer++ width split evenly across levels
    c.order = "fast_first"  # or "slow_first" (the paper's notation)
    c["update"] = "ntp"  # or "none": a static chain of MLPs (read it as cms["update"]: ConfigDict has .update)
    c.update(overrides)
    return c


def hope_config(**overrides) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mixer = "self_referential"  # or "attention" (Hope-Attention)
    c.update(overrides)
    return c


def level_widths(cfg) -> tuple:
    """`cms.widths`, or the SwiGLU width of `mlp_dim` split as evenly as possible over the levels."""
    if cfg.cms.widths:
        return tuple(int(w) for w in cfg.cms.widths)
    total, k = swiglu_width(cfg.d_model, cfg.mlp_dim), len(cfg.cms.periods)
    return tuple(total // k + (i < total % k) for i in range(k))


def first_pass_traffic(cfg, n_params: int, seq_len: int, sequences: int) -> tuple[int, float]:
    """`(passes, bytes)`: pass 1's sequential whole-model passes over one window and a lower bound on the HBM
    bytes they move per device for `sequences` sequences: each pass reads every weight twice (the chunk's
    forward and its backward to `Δ`, in the compute dtype) and each sequence's float32 `Δ` three times (read
    forward and backward, written by the update). Memory-bound: a pass multiplies `sequences x chunk` rows
    by each weight, far below a TPU's FLOP/byte ridge. `(0, 0.0)` for a static chain (`cms.update="none"`)."""
    if cfg.cms["update"] != "ntp":
        return 0, 0.0
    passes = -(-seq_len // min(cfg.cms.periods)) - 1
    delta = cfg.num_layers * sum(3 * cfg.d_model * w for w in level_widths(cfg)) * 4
    weight = 2 * n_params * np.dtype(cfg.dtype).itemsize
    return passes, float(passes * (weight + 3 * sequences * delta))


def _fail(key: str, value, why: str):
    raise UserError(f"invalid config value model.{key}={value!r}: {why}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate(config) -> None:
    """Refuse what the CMS or the mixer cannot run, in one line naming the key."""
    from nlearn.models import self_referential, transformer

    model = config.model
    cms = model.cms
    periods = cms.periods
    if not isinstance(periods, (tuple, list)) or not periods or not all(_is_int(p) and p >= 1 for p in periods):
        _fail("cms.periods", periods, "must be a non-empty tuple of integers >= 1")
    if any(p % min(periods) for p in periods):
        _fail("cms.periods", periods, f"every period must be a multiple of the smallest ({min(periods)})")
    k = len(periods)
    if (not isinstance(cms.lr, (tuple, list)) or len(cms.lr) != k
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in cms.lr)):
        _fail("cms.lr", cms.lr, f"must be a tuple of {k} numbers >= 0 (one per period)")
    if not isinstance(cms.learn_lr, bool):
        _fail("cms.learn_lr", cms.learn_lr, "must be True or False")
    if cms.learn_lr and not all(x > 0 for x in cms.lr):
        _fail("cms.lr", cms.lr, "must be > 0 with cms.learn_lr=True (each rate is learned as its logarithm)")
    decay = cms.decay
    if (not isinstance(decay, (tuple, list)) or len(decay) not in (1, k)
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < 1 for x in decay)):
        _fail("cms.decay", decay, f"must be a tuple of {k} numbers in [0, 1) (one per period) or of one for all")
    if not isinstance(cms.widths, (tuple, list)) or (
            cms.widths and (len(cms.widths) != k or not all(_is_int(w) and w >= 1 for w in cms.widths))):
        _fail("cms.widths", cms.widths, f"must be () or a tuple of {k} integers >= 1 (one per period)")
    if cms.order not in ORDERS:
        _fail("cms.order", cms.order, f"valid choices: {', '.join(ORDERS)}")
    if cms["update"] not in UPDATES:
        _fail("cms.update", cms["update"], f"valid choices: {', '.join(UPDATES)}")
    if model.hope.mixer not in MIXERS:
        _fail("hope.mixer", model.hope.mixer, f"valid choices: {', '.join(MIXERS)}")
    if model.hope.mixer == "self_referential":
        self_referential.validate(config)
    else:
        transformer.validate(config)
        if config.train.get("write_penalty", 0.0) > 0:
            _fail("hope.mixer", model.hope.mixer, "train.write_penalty charges the self-referential mixer's write "
                  "gate; attention has none")


def _make_mixer(cfg, layer_index: int, rngs):
    if cfg.hope.mixer == "attention":
        from nlearn.models.transformer import make_attention

        return make_attention(cfg, layer_index, rngs)
    from nlearn.layers.self_referential import SelfReferentialMixer

    return SelfReferentialMixer(cfg, rngs=rngs)


class HopeBlock(nnx.Module):
    """`h = x + mixer(Norm(x))`, then the CMS levels, each a pre-norm residual SwiGLU."""

    def __init__(self, cfg, mixer: nnx.Module, *, rngs: nnx.Rngs):
        k = len(cfg.cms.periods)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mixer = mixer
        self.cms = ContinuumMemory(cfg.d_model, periods=cfg.cms.periods, widths=level_widths(cfg), lrs=cfg.cms.lr,
                                   decays=cfg.cms.decay, learn_lr=cfg.cms.learn_lr, order=cfg.cms.order,
                                   eps=cfg.norm_eps, std=cfg.init_std,
                                   out_std=cfg.init_std / math.sqrt((k + 1) * cfg.num_layers), rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return self.mixer.init_cache(batch, max_len, dtype)

    def __call__(self, x_BTD, cache=None, deltas=None, segmented: bool = False, probes=None, factors=None):
        """`deltas` as `ContinuumMemory` takes them; with `probes` (pass 1) the cache comes back with the
        CMS's kernel inputs, `(cache, records)`; with `factors` (pass 2) each level's `Δ` per period is
        rebuilt from them."""
        y, cache = self.mixer(self.mixer_norm(x_BTD), cache)
        if probes is not None:
            h, records = self.cms.probed(x_BTD + y, deltas, probes)
            return h, (cache, records)
        if factors is not None:
            return self.cms.from_factors(x_BTD + y, factors), cache
        return self.cms(x_BTD + y, deltas, segmented), cache


class HopeModel(LanguageModel):
    """Tokens `[B, T]` -> logits `[B, T, V]`, with the CMS learning in context (module docstring).

    `Δ` pytrees are lists over blocks of lists over levels (in application order) of
    `{"gate", "up", "down": [B, ...]}`; with `model.scan_layers` one list over levels whose leaves
    carry a leading layers axis (`[L, B, ...]`), and every path runs the blocks by one scan."""

    block = HopeBlock
    decode_probes = False  # its decode scans the CMS (chunk or token steps) and takes no probe

    def __init__(self, cfg, make_mixer, *, rngs: nnx.Rngs):
        super().__init__(cfg, make_mixer, rngs=rngs)
        self.update = cfg.cms["update"]
        self.chunk = min(cfg.cms.periods)
        # The self-referential mixer's state depends on the position within its period (attention's does not).
        self.mixer_period = 1
        if cfg.hope.mixer == "self_referential":
            self.mixer_period = max(cfg.memory.chunk_memory, cfg.memory.chunk_other)
        self.phases = math.lcm(self.chunk, self.mixer_period) // self.chunk  # chunks per pass-1 scan step

    @property
    def cms(self) -> ContinuumMemory:
        """The first block's CMS (every block's periods and rates are the same)."""
        return self.layers.cms if self.scanned else self.blocks[0].cms

    def run(self, tokens_BT, caches=None, deltas=None, segmented: bool = False, probes=None, factors=None):
        """Logits and new caches with fixed `Δ` (None: `θ0`; segmented: one `Δ` per period), or with each
        period's `Δ` rebuilt from pass 1's `factors`; with `probes` the caches come back as `(caches, records)`
        (`HopeBlock`). The training forward (no caches) rematerialises each block when `model.remat` is on, as
        the other families do."""
        x = self.embed(tokens_BT, self.embed.table[...].dtype)
        remat, policy = self.remat and caches is None, REMAT_POLICIES[self.remat_policy]

        def apply(block, h, xs):
            cache, delta, probe, factor = xs
            return block(h, cache, delta, segmented, probe, factor)

        if self.scanned:
            x, new_caches = scan_layers(self.layers, apply, x, (caches, deltas, probes, factors), remat=remat,
                                        policy=policy)
            return self._logits(x), new_caches
        new_caches = []
        for i, block in enumerate(self.blocks):
            xs = tuple(None if z is None else z[i] for z in (caches, deltas, probes, factors))
            if remat:
                x, cache = nnx.remat(lambda blk, h, z: (apply(blk, h, z)[0], None), policy=policy)(block, x, xs)
            else:
                x, cache = apply(block, x, xs)
            new_caches.append(cache)
        return self._logits(x), new_caches

    def zero_delta(self, batch: int) -> list:
        if self.scanned:
            return per_layer(self.layers, lambda block: block.cms.zero_delta(batch))
        return [block.cms.zero_delta(batch) for block in self.blocks]

    def zero_probes(self, batch: int, tokens: int) -> list:
        if self.scanned:
            return per_layer(self.layers, lambda block: block.cms.zero_probes(batch, tokens))
        return [block.cms.zero_probes(batch, tokens) for block in self.blocks]

    def chunk_factors(self, tokens_BC, targets_BC, caches, deltas):
        """`(factors, caches after the chunk)`: per level the kernels' inputs and the gradients of the chunk's
        summed next-token loss at their outputs (`nlearn.layers.cms`), the chunk read from `caches` (a
        constant) with `deltas`."""
        b, c = tokens_BC.shape

        def loss(probes):
            logits, out = self.run(tokens_BC, caches, deltas, probes=probes)
            if self.scanned:
                new_caches, records = out
            else:
                new_caches, records = [o[0] for o in out], [o[1] for o in out]
            return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets_BC)), (new_caches, records)

        grads, (new_caches, records) = jax.grad(loss, has_aux=True)(self.zero_probes(b, c))
        merge = lambda r, g: {**r, **g}  # noqa: E731
        if self.scanned:
            return [merge(r, g) for r, g in zip(records, grads)], new_caches
        return [[merge(r, g) for r, g in zip(rb, gb)] for rb, gb in zip(records, grads)], new_caches

    def chunk_grads(self, tokens_BC, targets_BC, caches, deltas):
        """`(∇_Δ Σ_t ℓ_NTP(t), caches after the chunk)`: the chunk read from `caches` (a constant)."""
        factors, caches = self.chunk_factors(tokens_BC, targets_BC, caches, deltas)
        return jax.tree.map(factor_grads, factors, is_leaf=_is_level_factors), caches

    def learn(self, deltas, gsums, grads, pos):
        """Add one chunk's gradients; levels whose period divides `pos` (tokens seen) update."""
        rule = dict(periods=self.cms.periods, pos=pos, decays=self.cms.decays)
        if self.scanned:  # the update is elementwise: the stacked layers at once (learned rates: `[L]` each)
            return accumulate_and_update(deltas, gsums, grads, lrs=self.cms.rates(), **rule)
        out = [accumulate_and_update(d, s, g, lrs=block.cms.rates(), **rule)
               for d, s, g, block in zip(deltas, gsums, grads, self.blocks)]
        return [o[0] for o in out], [o[1] for o in out]

    def first_pass(self, tokens_BT) -> list:
        """Pass 1: per level the per-token factors of the gradients that move `Δ` (`nlearn.layers.cms`), leaves
        `[B, T', ·]` (scanned: `[L, B, T', ·]`), T' the tokens of the window's chunks but the last; a constant
        to the outer loss (the parameters enter under stop_gradient).

        A scan step walks `self.phases` chunks, one mixer period, so each chunk's place in the
        mixer's period is known when tracing and the mixer computes only the chunks it touches. The scan
        carries one `Δ` and one running sum per sequence, and emits only factors: no weight-sized copy per
        chunk."""
        b, t = tokens_BT.shape
        c, k = self.chunk, self.phases
        n = -(-t // c)
        graphdef, state = nnx.split(self)
        frozen = nnx.merge(graphdef, jax.tree.map(jax.lax.stop_gradient, state))
        # Pass 1 is a constant to the outer loss: its mixers run inside a scan and a grad, where nothing is sown,
        # and pass 2 reads the whole window again, so the write cost (`train.write_penalty`) is pass 2's alone.
        frozen.set_attributes(record_writes=False, raise_if_not_found=False)
        delta0 = frozen.zero_delta(b)
        if n == 1:
            return self._no_factors(b)
        steps = -(-(n - 1) // k)  # the n - 1 chunks whose gradients reach a later chunk of this window
        m = (n - 1) * c  # tokens[:, m] is the last target they need
        padded = jnp.pad(tokens_BT[:, :m + 1], ((0, 0), (0, (steps * k - n + 1) * c)))
        xs, ys = (jnp.moveaxis(z.reshape(b, steps, k, c), (1, 2), (0, 1))
                  for z in (padded[:, :-1], padded[:, 1:]))  # [steps, k, B, c]

        def body(carry, inp):
            s, x, y = inp
            out = []
            for j in range(k):
                def chunk(carry, j=j):
                    caches, deltas, gsums = carry
                    factors, caches = frozen.chunk_factors(x[j], y[j], frozen.at_phase(caches, j * c), deltas)
                    grads = jax.tree.map(factor_grads, factors, is_leaf=_is_level_factors)
                    deltas, gsums = frozen.learn(deltas, gsums, grads, (s * k + j + 1) * c)
                    return (caches, deltas, gsums), factors

                if (n - 1) % k and j >= (n - 1) % k:  # past the window's last chunk in the last step
                    shapes = jax.eval_shape(chunk, carry)[1]
                    carry, factors = jax.lax.cond(
                        s * k + j < n - 1, chunk,
                        lambda cc: (cc, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)), carry)
                else:
                    carry, factors = chunk(carry)
                out.append(factors)
            return carry, jax.tree.map(lambda *f: jnp.stack(f), *out)

        caches = frozen.init_mixer_caches(b, steps * k * c)
        _, factors = jax.lax.scan(body, (caches, delta0, delta0), (jnp.arange(steps, dtype=jnp.int32), xs, ys))
        # [steps, k, (L,) B, c, ·] -> [(L,) B, steps * k * c, ·], cut to the n - 1 chunks
        return jax.tree.map(lambda f: jnp.moveaxis(f, (0, 1), (-4, -3)).reshape(
            f.shape[2:-2] + (steps * k * c, f.shape[-1]))[..., :m, :], factors)

    def _no_factors(self, batch: int) -> list:
        """Factors of no tokens (a window of one chunk: nothing reaches a later chunk)."""
        def level(probes):
            z = jnp.zeros(probes["down"].shape[:-2] + (0, probes["down"].shape[-1]), jnp.float32)
            a = jnp.zeros(probes["gate"].shape[:-2] + (0, probes["gate"].shape[-1]), jnp.float32)
            return {"z": z, "a": a, "gate": a, "up": a, "down": z}

        return jax.tree.map(level, self.zero_probes(batch, 1), is_leaf=lambda x: isinstance(x, dict))

    def adapt(self, tokens_BT):
        """The `Δ` each chunk of `self.chunk` tokens uses, leaves `[n_chunks, B, ...]` (scanned
        `[n_chunks, L, B, ...]`), rebuilt from `first_pass` as the parallel pass does; for inspection
        and tests (training never holds it)."""
        t, c = tokens_BT.shape[1], self.chunk
        n = -(-t // c)
        factors = self.first_pass(tokens_BT)
        cms = self.cms

        def per_chunk(f, period, lr, decay):
            stack = deltas_from_factors(f, period=period, n_segments=-(-t // period), lr=lr, decay=decay,
                                        dtype=jnp.float32)
            return jax.tree.map(lambda d: d[np.arange(n) * c // period], stack)

        if self.scanned:  # layers vmapped (each layer's rates): leaves [L, B, T', ·] -> [n, L, B, ...]
            n_layers = factors[0]["z"].shape[0]
            lrs = [jnp.broadcast_to(jnp.asarray(lr, jnp.float32), (n_layers,)) for lr in cms.rates()]
            return [jax.tree.map(lambda d: jnp.moveaxis(d, 0, 1), jax.vmap(
                lambda ff, lr, p=p, dc=dc: per_chunk(ff, p, lr, dc))(f, lr))
                for f, p, lr, dc in zip(factors, cms.periods, lrs, cms.decays)]
        return [[per_chunk(f, *r) for f, r in zip(block_f, zip(blk.cms.periods, blk.cms.rates(), blk.cms.decays))]
                for block_f, blk in zip(factors, self.blocks)]

    def at_phase(self, caches, pos: int):
        """The mixers' caches told their stream position within a period as a Python int (pass 1
        knows it), so the self-referential op runs only the chunks a chunk of tokens touches."""
        if self.mixer_period == 1:
            return caches

        def told(cache):  # scanned: one position for the stacked layers, which a scan over them leaves whole
            return dict(cache, state=cache["state"]._replace(pos=np.int32(pos % self.mixer_period)))

        return told(caches) if self.scanned else [told(cache) for cache in caches]

    def per_period(self, chunk_deltas) -> list:
        """Per-chunk `Δ` (leaves `[n_chunks, ...]`) -> per level one `Δ` per period (`[N_ℓ, B, ...]`;
        scanned: `[L, N_ℓ, B, ...]`)."""
        c, periods = self.chunk, self.cms.periods
        if self.scanned:
            return [jax.tree.map(lambda x, s=p // c: jnp.moveaxis(x[::s], 0, 1), level)
                    for level, p in zip(chunk_deltas, periods)]
        return [[jax.tree.map(lambda x, s=p // c: x[::s], level) for level, p in zip(block_d, periods)]
                for block_d in chunk_deltas]

    def __call__(self, tokens_BT):
        if self.update == "none":
            return self.run(tokens_BT)[0]
        return self.run(tokens_BT, factors=self.first_pass(tokens_BT))[0]

    def init_mixer_caches(self, batch: int, max_len: int, dtype=None):
        return super().init_cache(batch, max_len, dtype or self.embed.table[...].dtype)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """The mixers' caches; with updates also `Δ`, the running sums, the current chunk's tokens
        and the mixers' caches at its start (all of a size independent of the stream's length)."""
        caches = self.init_mixer_caches(batch, max_len, dtype)
        if self.update == "none":
            return caches
        zero = self.zero_delta(batch)
        return {"mix": caches, "start": caches, "buf": jnp.zeros((batch, self.chunk), jnp.int32),
                "pos": jnp.zeros((), jnp.int32), "delta": zero, "gsum": zero}

    def rebase_cache(self, cache):
        """`cache` as it is: its `pos` counts every token read (the CMS chunks' and levels' clocks)."""
        return cache

    @property
    def decode_span(self) -> int:
        """Pieces of this many tokens that start at a multiple of it decode a CMS chunk per step (`decode`)."""
        return 1 if self.update == "none" else self.chunk * self.phases

    def decode(self, tokens_BT, cache):
        """Feed `tokens [B, T]` after what `cache` holds, learning as the full forward does: a CMS chunk per step
        where the piece is whole mixer periods from a period's start (`decode_span`), else token by token."""
        if self.update == "none":
            return self.run(tokens_BT, cache)
        span = self.decode_span
        if tokens_BT.shape[1] % span:
            return self._decode_tokens(tokens_BT, cache)
        return jax.lax.cond(cache["pos"] % span == 0, self._decode_chunks, self._decode_tokens, tokens_BT, cache)

    def _learn_previous_chunk(self, cache, tok_B, phase=None):
        """`cache` once the CMS has learnt from the chunk in `buf`, whose last target is `tok_B`; `phase`, the
        chunk's start within the mixer's period (traced: one branch per place), lets the mixer compute only the
        chunks it touches (`at_phase`)."""
        c, k = self.chunk, self.phases
        targets = jnp.concatenate([cache["buf"][:, 1:], tok_B[:, None]], axis=1)

        def grads_at(j):
            return lambda: self.chunk_grads(cache["buf"], targets, self.at_phase(cache["start"], j * c),
                                            cache["delta"])[0]

        if phase is not None:
            grads = grads_at(phase)()
        else:
            grads = jax.lax.switch((cache["pos"] // c - 1) % k, [grads_at(j) for j in range(k)])
        delta, gsum = self.learn(cache["delta"], cache["gsum"], grads, cache["pos"])
        return dict(cache, delta=delta, gsum=gsum, start=cache["mix"])

    def _decode_tokens(self, tokens_BT, cache):
        """`decode` token by token: the CMS learns from a chunk once the token after it arrives."""
        c = self.chunk

        def step(cache, tok_B):
            pos = cache["pos"]
            cache = jax.lax.cond((pos > 0) & (pos % c == 0), self._learn_previous_chunk, lambda cc, _: cc,
                                 cache, tok_B)
            logits, mix = self.run(tok_B[:, None], cache["mix"], cache["delta"])
            buf = cache["buf"].at[:, pos % c].set(tok_B)
            return dict(cache, mix=mix, buf=buf, pos=pos + 1), logits[:, 0]

        cache, logits = jax.lax.scan(step, cache, jnp.swapaxes(tokens_BT, 0, 1))
        return jnp.swapaxes(logits, 0, 1), cache

    def _decode_chunks(self, tokens_BT, cache):
        """`decode` of whole mixer periods from a period's start: each CMS chunk read at once with the `Δ` it
        uses (the CMS learns only between chunks), the chunks' places in the period known when tracing."""
        b, t = tokens_BT.shape
        c, k = self.chunk, self.phases
        xs = jnp.moveaxis(tokens_BT.reshape(b, t // (c * k), k, c), (1, 2), (0, 1))  # [steps, k, B, c]

        def body(cache, x):
            out = []
            for j in range(k):
                previous = (j - 1) % k
                if j == 0:  # at the stream's start there is no previous chunk
                    cache = jax.lax.cond(cache["pos"] > 0, partial(self._learn_previous_chunk, phase=previous),
                                         lambda cc, _: cc, cache, x[j][:, 0])
                else:
                    cache = self._learn_previous_chunk(cache, x[j][:, 0], previous)
                logits, mix = self.run(x[j], self.at_phase(cache["mix"], j * c), cache["delta"])
                cache = dict(cache, mix=mix, buf=x[j], pos=cache["pos"] + c)
                out.append(logits)
            return cache, jnp.stack(out)  # [k, B, c, V]

        cache, logits = jax.lax.scan(body, cache, xs)  # [steps, k, B, c, V]
        return jnp.moveaxis(logits, 2, 0).reshape(b, t, -1), cache


# Its decode steps the CMS inside a scan, where a layer cannot report a write cost: the write
# cost trains without state passing.
register("hope", _make_mixer, validate, model=HopeModel, flops=flops.hope, serial_traffic=first_pass_traffic,
         write_cost=True, decode_write_cost=False, optional_write_gate=True,
         # runs saved before CMS retention and learned rates
         migrations=(*SELF_REFERENTIAL_MIGRATIONS, ("model.cms.decay", (0.0,)), ("model.cms.learn_lr", False)))
