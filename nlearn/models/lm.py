"""The language-model backbone every family shares: embed -> blocks -> norm -> head.

A block is pre-norm residual `x + mixer(norm(x))` then `x + mlp(norm(x))`; families differ only
in the mixer (attention, a memory op, a Titans wiring), chosen through the registry.

With `model.scan_layers=True` the blocks are one `Block` whose parameters are stacked on a leading
`layers` axis (attribute `layers` instead of the list `blocks`), built and run by a `lax.scan` so that
the compiled init and step hold one block whatever the depth; the parameters are those of the unscanned
model from the same seed, stacked (`stack_blocks` / `unstack_blocks` map one layout to the other).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nlearn.layers.batch_split import constrain
from nlearn.layers.core import Dense, Embed, RMSNorm, SwiGLU, swiglu_width

STACKED = "layers"  # attribute, parameter key and logical axis name of the stacked blocks

# What a rematerialised block keeps for the backward pass (`model.remat_policy`, with `model.remat`):
# "full" recomputes everything, the others keep matmul outputs (see `jax.checkpoint_policies`).
REMAT_POLICIES = {
    "full": None,  # jax.checkpoint's default: nothing saved
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Block(nnx.Module):
    """Pre-norm residual block around one token mixer and a SwiGLU MLP."""

    def __init__(self, cfg, mixer: nnx.Module, *, rngs: nnx.Rngs):
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mixer = mixer
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mlp = SwiGLU(cfg.d_model, swiglu_width(cfg.d_model, cfg.mlp_dim), std=std,
                          out_std=out_std, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return self.mixer.init_cache(batch, max_len, dtype)

    def rebase_cache(self, cache):
        """The mixer's `rebase_cache` (an equivalent state with its position counters brought back to where
        a fresh state starts, where that changes no output), or `cache` as it is."""
        rebase = getattr(self.mixer, "rebase_cache", None)
        return cache if rebase is None else rebase(cache)

    def __call__(self, x_BTD, cache=None):
        y, cache = self.mixer(self.mixer_norm(x_BTD), cache)
        x_BTD = x_BTD + y
        return constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD))), cache


# (model_cfg, layer_index, rngs) -> mixer module; layer_index is a traced int32 under model.scan_layers
MixerFactory = Callable[..., nnx.Module]


def scan_init(n: int, make_block: Callable, rngs: nnx.Rngs, family: str) -> nnx.Module:
    """`n` blocks `make_block(layer_index, rngs)` stacked on a leading `layers` axis (logical axis name
    included), built by one `lax.scan` so that the init program holds one block whatever `n`. The scan
    carries `rngs`' counters: layer i draws the keys the i-th of `n` blocks built in turn would (same seed,
    same parameters), and `rngs` ends where that loop would leave it. `layer_index` is a traced int32."""
    from nlearn.errors import UserError

    rng_graphdef, rng_state = nnx.split(rngs)
    graphdef = None

    def body(rng_state, i):
        nonlocal graphdef
        layer_rngs = nnx.merge(rng_graphdef, rng_state)
        graphdef, state = nnx.split(make_block(i, layer_rngs))
        return nnx.split(layer_rngs)[1], state

    try:
        rng_state, state = jax.lax.scan(body, rng_state, jnp.arange(n, dtype=jnp.int32))
    except jax.errors.ConcretizationTypeError as e:
        raise UserError(f"model.scan_layers=True: the layers of family {family!r} differ by index, so they "
                        "cannot be stacked; set model.scan_layers=False") from e
    nnx.update(rngs, rng_state)
    return nnx.merge(graphdef, nnx.spmd.add_axis(state, 0, {nnx.PARTITION_NAME: STACKED}))


def stack_blocks(params: dict) -> dict:
    """Pure parameter dict of an unscanned model (`blocks: {0: .., 1: ..}`) -> the scanned layout."""
    blocks = params["blocks"]
    out = {k: v for k, v in params.items() if k != "blocks"}
    out[STACKED] = jax.tree.map(lambda *xs: jnp.stack(xs), *(blocks[i] for i in range(len(blocks))))
    return out


def unstack_blocks(params: dict) -> dict:
    """Pure parameter dict of a scanned model -> the unscanned layout."""
    layers = params[STACKED]
    out = {k: v for k, v in params.items() if k != STACKED}
    n = jax.tree.leaves(layers)[0].shape[0]
    out["blocks"] = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)}
    return out


def _shared(leaf) -> bool:
    """A 0-d value that is not a jax array: known when tracing and the same for every layer (a stream
    position pass 1 fixes), so a scan over layers passes it as it is instead of slicing it."""
    return not isinstance(leaf, jax.Array) and np.ndim(leaf) == 0


def scan_layers(layers: nnx.Module, fn, carry, xs, *, remat: bool = False, policy=None):
    """`fn(block, carry, xs_l) -> (carry, ys_l)` for every layer of the stacked module `layers`, as one
    `lax.scan`: `xs` leaves carry a leading layers axis (or are `_shared`), `ys` come back stacked.
    `remat`: each layer rematerialised in the backward pass, keeping what `policy` saves."""
    graphdef, state = nnx.split(layers)
    leaves, treedef = jax.tree.flatten(xs)
    shared = [_shared(leaf) for leaf in leaves]

    def body(c, layer):
        layer_state, sliced = layer
        it = iter(sliced)
        xs_l = jax.tree.unflatten(treedef, [leaf if s else next(it) for leaf, s in zip(leaves, shared)])
        return fn(nnx.merge(graphdef, layer_state), c, xs_l)

    if remat:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    return jax.lax.scan(body, carry, (state, [leaf for leaf, s in zip(leaves, shared) if not s]))


def per_layer(layers: nnx.Module, fn, *xs):
    """`fn(block, *xs_l)` of every layer of the stacked module `layers` (`xs` leaves stacked on a leading
    layers axis, as the decoding caches), its leaves stacked on a leading layers axis."""
    graphdef, state = nnx.split(layers)
    return jax.vmap(lambda s, *x: fn(nnx.merge(graphdef, s), *x))(state, *xs)


class LanguageModel(nnx.Module):
    """Maps int tokens `[B, T]` to float32 logits `[B, T, V]`; `decode` carries a cache.
    A subclass may set `block` to another `(cfg, mixer, rngs=)` block class."""

    block = Block
    decode_probes = True  # `decode(..., probe=)` shows a probe every block's input
    decode_span = 1  # `decode` is fastest on pieces of this many tokens from a multiple of it (eval.streaming)

    def __init__(self, cfg, make_mixer: MixerFactory, *, rngs: nnx.Rngs):
        self.remat = cfg.remat
        self.remat_policy = cfg.remat_policy
        self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.init_std, rngs=rngs)
        def make_block(i, rngs):
            return self.block(cfg, make_mixer(cfg, i, rngs), rngs=rngs)

        if cfg.scan_layers:
            self.layers = scan_init(cfg.num_layers, make_block, rngs, cfg.family)
        else:
            self.blocks = nnx.List([make_block(i, rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.head = None if cfg.tie_embeddings else Dense(
            cfg.d_model, cfg.vocab_size, axes=("embed", "vocab"), std=cfg.init_std, rngs=rngs)

    @property
    def scanned(self) -> bool:
        return hasattr(self, STACKED)

    def _logits(self, x_BTD):
        x_BTD = self.final_norm(x_BTD)
        logits = self.embed.attend(x_BTD) if self.head is None else constrain(self.head(x_BTD))
        return logits.astype(jnp.float32)

    def _run_blocks(self, x_BTD, cache=None):
        """All blocks in order; the training forward (no cache) rematerialised when `remat` is on.
        Scanned: one `lax.scan` over the stacked parameters and the stacked cache."""
        remat = self.remat and cache is None
        policy = REMAT_POLICIES[self.remat_policy]
        if not self.scanned:
            new_cache = []
            for i, block in enumerate(self.blocks):
                if cache is not None:
                    x_BTD, layer_cache = block(x_BTD, cache[i])
                    new_cache.append(layer_cache)
                elif remat:
                    x_BTD = nnx.remat(lambda blk, h: blk(h)[0], policy=policy)(block, x_BTD)
                else:
                    x_BTD = block(x_BTD)[0]
            return x_BTD, (None if cache is None else new_cache)
        return scan_layers(self.layers, lambda block, x, layer_cache: block(x, layer_cache), x_BTD, cache,
                           remat=remat, policy=policy)

    def __call__(self, tokens_BT):
        x = self.embed(tokens_BT, self.embed.table[...].dtype)
        return self._logits(self._run_blocks(x)[0])

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        """Per-layer decoding state: KV ring buffers for attention, memory states for the rest (a list
        over layers; scanned: one pytree whose leaves are stacked on a leading `layers` axis)."""
        if not self.scanned:
            return [block.init_cache(batch, max_len, dtype) for block in self.blocks]
        return per_layer(self.layers, lambda block: block.init_cache(batch, max_len, dtype))

    def rebase_cache(self, cache):
        """`cache` with each block's position counters brought back to a fresh state's where no output
        changes (Block.rebase_cache), so train.state_passing can keep rows of a family that counts positions."""
        if not self.scanned:
            return [block.rebase_cache(layer_cache) for block, layer_cache in zip(self.blocks, cache)]
        return per_layer(self.layers, lambda block, layer_cache: block.rebase_cache(layer_cache), cache)

    def decode(self, tokens_BT, cache, probe=None):
        """Feed `tokens [B, T]` (a prompt, or one new token) after what `cache` holds. `probe(block,
        x_BTD, layer_cache)`, if given, sees every block's input before the block runs (diagnostics)."""
        x = self.embed(tokens_BT, self.embed.table[...].dtype)
        if probe is None:
            x, cache = self._run_blocks(x, cache)
            return self._logits(x), cache
        if self.scanned:
            raise ValueError("decode(probe=...) runs the blocks one by one: it needs model.scan_layers=False")
        new_cache = []
        for block, layer_cache in zip(self.blocks, cache):
            probe(block, x, layer_cache)
            x, layer_cache = block(x, layer_cache)
            new_cache.append(layer_cache)
        return self._logits(x), new_cache
