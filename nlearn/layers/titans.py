"""Titans backbones' token mixers (Behrouz et al. 2025, §4): memory as a context (MAC), as a gate
(MAG) and as a layer (MAL). Each combines three memories: the neural long-term memory (LMM, the
`NeuralMemoryMixer`), short-term attention (segment-local for MAC, sliding window for MAG / MAL)
and persistent memory (learned always-visible attention keys/values, see `layers.attention`).

Every mixer follows the backbone's contract `__call__(x_BTD, cache=None) -> (y, cache)`; caches
hold a memory state plus a bounded attention cache, so generation costs constant memory per token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from nlearn.layers.attention import Attention, masked_attention, with_prefix_mask
from nlearn.layers.core import Dense, RMSNorm, head_dim
from nlearn.layers.mixers import NeuralMemoryMixer, l2_normalize
from nlearn.memory.neural_memory import NeuralMemoryState, mlp_apply


def mlp_read(theta, q_BTHD, *, activation: str = "gelu", residual: bool = False, precision=lax.Precision.HIGHEST):
    """Pure read `f(q; θ)` of the memory MLP (no write): θ a tuple of `[B, H, d_in, d_out]`,
    `q [B, T, H, d]` -> `[B, T, H, d_out]`; the memory op's own `mlp_apply` in token-major layout.
    `precision` of the matmuls: HIGHEST by default, so a float32 read stays float32 where the
    backend would otherwise round matmul inputs (TF32 / bf16 passes on GPU and TPU)."""
    o = mlp_apply(theta, jnp.swapaxes(q_BTHD, 1, 2), activation=activation, residual=residual, precision=precision)
    return jnp.swapaxes(o, 1, 2)


def _attention(cfg, *, window: int, out_proj: bool = True, rngs: nnx.Rngs) -> Attention:
    return Attention(cfg.d_model, cfg.num_heads, head_dim(cfg), window=window,
                     num_persistent=cfg.num_persistent, rope_theta=cfg.rope_theta, std=cfg.init_std,
                     out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), out_proj=out_proj,
                     conv_size=cfg.attn_conv_size, rngs=rngs)


UNROLL_SEGMENTS = 8  # MAC unrolls its loop over segments up to this many segments
MAC_OUTPUTS = ("add", "gate")  # how MAC combines the attention output and the memory's read
MAC_MEMORY_INPUTS = ("y", "x+y", "x")  # what MAC's memory writes and reads with: y (eq. 24), x + y or x
MAC_POSITIONS = ("absolute", "segment")  # MAC's RoPE positions: in the stream, or from the segment's start
MAG_OUTPUTS = ("blend", "gate")  # MAG: convex blend of the two branches, or y ⊙ σ(M(x)) (eq. 28)
MAL_ATTN_INPUTS = ("x+m", "m")  # MAL: attention on RMSNorm(x + M(x)) plus M(x), or on M(x) alone (eq. 31)


def mac_output(cfg) -> str:
    """`model.mac_output` (older saved configs get the gate from `nlearn.config.migrate`)."""
    return cfg.mac_output


def mac_positions(cfg) -> str:
    """`model.mac_positions` (older saved configs get "absolute" from `nlearn.config.migrate`)."""
    return cfg.mac_positions


def mac_memory_input(cfg) -> str:
    """`model.mac_memory_input` (older saved configs get x + y from `nlearn.config.migrate`)."""
    return cfg.mac_memory_input


def mag_output(cfg) -> str:
    """`model.mag_output` (older saved configs get the blend from `nlearn.config.migrate`)."""
    return cfg.mag_output


def mal_attn_input(cfg) -> str:
    """`model.mal_attn_input` (older saved configs attend to x + M(x), from `nlearn.config.migrate`)."""
    return cfg.mal_attn_input


def _select(flag, a, b):
    """`a` where the scalar `flag` holds, else `b` (leaf by leaf)."""
    return jax.tree_util.tree_map(lambda x, y: jnp.where(flag, x, y), a, b)


# ----------------------------------------------------------------------------------------------
# MAC


class MACMixer(nnx.Module):
    """Memory as a context (Titans eqs. 21-25). The stream is cut into segments of C =
    `segment_len` tokens; per segment

      1. retrieve `h_j = M*_{s-1}(q_j)`, q_j = L2(SiLU(x_j W_R)) (eq. 21): a pure read of the memory
         MLP with the state left by the previous segments (the current segment's writes are
         invisible); `r_j = RMSNorm(h_j W_h)` are the retrieved tokens;
      2. attend over `[persistent ‖ r ‖ x]` of this segment (eqs. 22-23): query i sees all N_p
         persistent entries and r_j, x_j for j <= i (r_j depends on x_j, so this keeps causality),
         giving `y = Attn(...) W_o` (N_p + 2C keys per query: O(T·C), never a T×T mask). RoPE rotates
         queries and keys by their place in the stream (`model.mac_positions="absolute"`) or in their
         segment (`"segment"`): then every segment's attention is the same function of its inputs at any
         length, where absolute positions turn the queries against the unrotated persistent keys to
         angles a short training window never showed;
      3. write into the memory (eq. 24): the LMM mixer over the segment from the state after the
         previous segment, its k, v, q projections of u = RMSNorm(y) (`model.mac_memory_input="y"`,
         the paper), RMSNorm(x + y) (`"x+y"`: the attention sub-layer's output with its residual)
         or RMSNorm(x) (`"x"`: the segment's tokens). Writes and reads go token by token: the read
         at token t is `M*_t(q(u_t))`, the memory after the writes of the segment's tokens up to t
         (after the whole segment's writes a token would read later tokens: not causal);
      4. combine y with that read (eq. 25): `model.mac_output="gate"`: `o = y ⊙ σ(RMSNorm(m))`,
         `"add"`: `o = y + m`, m being the LMM mixer's output (its read, RMS-normalised per head,
         through its SiLU output gate and output projection, Titans §4.4). The RMSNorm (learned
         scale) inside σ sets the gate's input to unit scale: m itself starts at the output
         projection's small init, where σ(m) ≈ 1/2 everywhere and the read could not gate.
         With "y" and "gate" this is eq. 25, `o = y ⊗ M*_t(y)`.

    The persistent tokens are attention entries only, never written into the memory (as in the
    paper's MAC, eq. 22). The queries, keys and values of the segment's tokens go through short
    causal convs (`model.attn_conv_size`, Titans §4.4; not the retrieved tokens, which are no
    stream). Why the small presets use "add" with "x" instead: docs/titans.md.

    `lax.scan` over segments carries the memory state and the LMM's conv state. Decoding keeps the
    retrieval weights of the current segment, the LMM's stream state and the current segment's
    attention keys/values (at most C of each), so memory per token is constant.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.segment_len = cfg.segment_len
        self.num_heads, self.head_dim = cfg.num_heads, head_dim(cfg)
        width = self.num_heads * self.head_dim
        mem = cfg.memory
        self.read_options = dict(activation=mem.activation, residual=mem.residual)
        # Segments that start on a mini-batch boundary let the memory op take its static fast path.
        self.aligned = cfg.segment_len % mem.minibatch == 0
        self.attn = _attention(cfg, window=0, rngs=rngs)
        self.retrieve_q = Dense(cfg.d_model, width, axes=("embed", "heads"), std=cfg.init_std, rngs=rngs)
        self.retrieve_o = Dense(width, cfg.d_model, axes=("heads", "embed"), std=cfg.init_std, rngs=rngs)
        self.retrieved_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.lmm_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.lmm = NeuralMemoryMixer(cfg, rngs=rngs)
        self.lmm.defer_writes = True  # its write cost comes back through the segment scan; `_forward` sows it
        self.combine = mac_output(cfg)
        self.memory_input = mac_memory_input(cfg)
        self.segment_positions = mac_positions(cfg) == "segment"
        self.gate_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs) if self.combine == "gate" else None

    # --- pieces shared by training and decoding -----------------------------------------------
    def _retrieval_query(self, x_BTD):
        b, t, _ = x_BTD.shape
        q = self.retrieve_q(x_BTD).reshape(b, t, self.num_heads, self.head_dim)
        return l2_normalize(jax.nn.silu(q))

    def _retrieve(self, theta, q_r, pos_T):
        """The memory's answers `h = M*(q_r) [B, T, H, D]` under weights θ, and the keys and
        values of the retrieved tokens they make."""
        b, t = q_r.shape[:2]
        h = mlp_read(theta, q_r, **self.read_options).astype(q_r.dtype)
        r = self.retrieved_norm(self.retrieve_o(h.reshape(b, t, -1)))
        return h, self.attn.key_value(r, pos_T)

    def _keys(self, b, dtype, k_r, v_r, k_x, v_x):
        """`[persistent ‖ retrieved ‖ segment]` keys and values."""
        pkv = self.attn.persistent_kv(b, dtype)
        ks, vs = [k_r, k_x], [v_r, v_x]
        if pkv is not None:
            ks, vs = [pkv[0]] + ks, [pkv[1]] + vs
        return jnp.concatenate(ks, 1), jnp.concatenate(vs, 1)

    def _output(self, x_BTD, y_BTHK, lmm_cache):
        """Steps 3-4: write `model.mac_memory_input` (y, x + y or x) into the memory token by
        token, read it with the same input as query, combine y with the read. Also returns the
        memory's write cost (0 unless `train.write_penalty` records it)."""
        y = self.attn.project_out(y_BTHK)
        u = {"y": y, "x+y": x_BTD + y, "x": x_BTD}[self.memory_input]
        m, lmm_cache = self.lmm(self.lmm_norm(u), lmm_cache)
        cost = lmm_cache.pop("write_cost", jnp.zeros((), jnp.float32))
        if self.combine == "add":
            return y + m, lmm_cache, cost
        return y * jax.nn.sigmoid(self.gate_norm(m)), lmm_cache, cost

    def _lmm_state_in(self, state: NeuralMemoryState, length: int):
        # A (θ, U) pair starts a new mini-batch statically (fast path of the op); a stream state
        # (traced position) is needed mid-mini-batch and by the one-token step.
        if self.aligned and length > 1:
            return (state.theta, state.U)
        return state

    def _segment(self, carry, seg):
        """One segment of L <= C tokens starting on a segment boundary (training / prefill)."""
        state, convs = carry
        x, q_r, q, k_x, v_x, pos = seg
        b, length = q.shape[:2]
        h, (k_r, v_r) = self._retrieve(state.theta, q_r, pos)
        keys, values = self._keys(b, k_x.dtype, k_r, v_r, k_x, v_x)
        causal = np.tril(np.ones((length, length), bool))
        n_p = keys.shape[1] - 2 * length
        mask = with_prefix_mask(jnp.asarray(np.concatenate([causal, causal], 1)), n_p)
        y = masked_attention(q, keys, values, mask)
        out, lmm_cache, cost = self._output(x, y, {"convs": convs, "state": self._lmm_state_in(state, length)})
        # Same dtypes as the carry that came in (the op may compute in the activations' dtype).
        new = jax.tree_util.tree_map(lambda a, b_: a.astype(b_.dtype), tuple(lmm_cache["state"]), tuple(state))
        return (NeuralMemoryState(*new), lmm_cache["convs"]), (out, h, (k_r, v_r, k_x, v_x), cost)

    def _segments(self, x_BTD, start, state, convs, attn_convs=None):
        """Whole segments then a remainder, from a segment boundary at absolute position `start`.

        Returns the outputs, the retrieved `h [B, T, H, D]`, the carry before and after the last
        (possibly partial) segment, that segment's keys/values (None when C divides T), the
        attention convs' cache (None when `attn_convs` is) and the memory's write cost per segment."""
        b, t, _ = x_BTD.shape
        c = self.segment_len
        pos = start + jnp.arange(t, dtype=jnp.int32)
        if self.segment_positions:  # every segment's tokens at RoPE positions 0 .. C-1
            pos = pos % c
        q_r = self._retrieval_query(x_BTD)
        q, k_x, v_x, attn_convs = self.attn.qkv(x_BTD, pos, attn_convs)
        seqs = (x_BTD, q_r, q, k_x, v_x)
        n, rem = divmod(t, c)
        carry = (state, convs)
        outs, hs, costs = [], [], []
        if n:
            def split(z):  # [B, n*C, ...] -> [n, B, C, ...]
                z = z[:, :n * c]
                return jnp.moveaxis(z.reshape((b, n, c) + z.shape[2:]), 1, 0)

            xs = tuple(split(z) for z in seqs) + (pos[:n * c].reshape(n, c),)
            # Unrolled when short (XLA fuses across the segments: ~5-10% faster at the
            # MQAR shapes, 4 segments); a rolled loop keeps long sequences' compile time flat.
            unroll = n if n <= UNROLL_SEGMENTS else 1
            carry, (out, h, _, cost) = lax.scan(self._segment, carry, xs, unroll=unroll)
            merge = lambda z: jnp.moveaxis(z, 0, 1).reshape((b, n * c) + z.shape[3:])  # noqa: E731
            outs.append(merge(out))
            hs.append(merge(h))
            costs.append(cost)
        last_kv = None
        before_last = carry
        if rem:
            seg = tuple(z[:, n * c:] for z in seqs) + (pos[n * c:],)
            carry, (out, h, last_kv, cost) = self._segment(carry, seg)
            outs.append(out)
            hs.append(h)
            costs.append(cost[None])
        return (jnp.concatenate(outs, 1), jnp.concatenate(hs, 1), before_last, carry, last_kv, attn_convs,
                jnp.concatenate(costs))

    # --- training -----------------------------------------------------------------------------
    def __call__(self, x_BTD, cache=None):
        if cache is not None:
            return self._decode(x_BTD, cache)
        return self._forward(x_BTD)[0], None

    def _forward(self, x_BTD):
        # Pad to whole segments (one scan body to compile): padding comes after every real token,
        # so it changes no output; only the final state, which training does not keep.
        b, t, d = x_BTD.shape
        pad = -t % self.segment_len
        x = jnp.concatenate([x_BTD, jnp.zeros((b, pad, d), x_BTD.dtype)], 1) if pad else x_BTD
        lmm0 = self.lmm.init_cache(b, 0, x_BTD.dtype)
        out, h, *_, costs = self._segments(x, 0, lmm0["state"], lmm0["convs"])
        if self.lmm.record_writes:  # the padding's writes are charged too: their gates are the model's as well
            self.sow(nnx.Intermediate, "sown_write_cost", jnp.mean(costs))
        return out[:, :t], h[:, :t]

    def retrieved(self, x_BTD):
        """`h = M*_{s-1}(q) [B, T, H, D]`: what each token retrieves from the memory left by the
        segments before its own (for tests and inspection)."""
        return self._forward(x_BTD)[1]

    def inner_losses(self, x_BTD, cache):
        """The LMM's inner loss before and after each write (`MemoryMixer.inner_losses`) when it writes the
        segment's tokens (`mac_memory_input="x"`); None when it writes attention outputs, which only the
        segment loop sees."""
        if self.memory_input != "x":
            return None
        return self.lmm.inner_losses(self.lmm_norm(x_BTD), cache["lmm"])

    # --- decoding -----------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        shape = (batch, self.segment_len, self.num_heads, self.head_dim)
        lmm = self.lmm.init_cache(batch, max_len, dtype)
        return {"retrieval": lmm["state"].theta, "lmm": lmm, "attn_convs": self.attn.init_conv_cache(batch, dtype),
                "kv": tuple(jnp.zeros(shape, dtype) for _ in range(4)),  # k_r, v_r, k_x, v_x
                "next": jnp.zeros((), jnp.int32)}

    def rebase_cache(self, cache):
        """With `model.mac_positions="segment"`, the same decoding state with its position counted from the
        current segment's start: outputs then depend on `next` only through its place in the segment, so a state
        at a segment boundary continues from 0 as a fresh one does (train.state_passing keeps a row only where
        the shared leaves agree with a fresh row's). With absolute positions the queries' rotation against the
        unrotated persistent keys depends on `next` itself: the cache is returned as it is."""
        if not self.segment_positions:
            return cache
        return {**cache, "next": cache["next"] % self.segment_len}

    def _step(self, x_B1D, cache):
        """One token: retrieve with the segment's start weights, attend to the segment so far. Returns the
        output, the cache and the memory's write cost (0 unless recorded)."""
        b = x_B1D.shape[0]
        c = self.segment_len
        pos = cache["next"]
        p = pos % c
        pos_T = (p if self.segment_positions else pos)[None]
        _, (k_r, v_r) = self._retrieve(cache["retrieval"], self._retrieval_query(x_B1D), pos_T)
        q, k_x, v_x, attn_convs = self.attn.qkv(x_B1D, pos_T, cache["attn_convs"])
        kv = tuple(lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), p, axis=1)
                   for buf, new in zip(cache["kv"], (k_r, v_r, k_x, v_x)))
        keys, values = self._keys(b, k_x.dtype, *(z.astype(k_x.dtype) for z in kv))
        seen = jnp.arange(c) <= p
        n_p = keys.shape[1] - 2 * c
        mask = with_prefix_mask(jnp.concatenate([seen, seen])[None], n_p)  # [1, N_p + 2C]
        y = masked_attention(q, keys, values, mask)
        out, lmm, cost = self._output(x_B1D, y, cache["lmm"])
        # The segment ends with this token: later tokens retrieve from the memory it leaves.
        retrieval = _select(p == c - 1, lmm["state"].theta, cache["retrieval"])
        return out, {"retrieval": retrieval, "lmm": lmm, "attn_convs": attn_convs, "kv": kv, "next": pos + 1}, cost

    def _prefill(self, x_BTD, cache):
        """T tokens from a segment boundary: the training path (segments in parallel)."""
        t = x_BTD.shape[1]
        c = self.segment_len
        lmm = cache["lmm"]
        out, _, before, (state, convs), last_kv, attn_convs, costs = self._segments(
            x_BTD, cache["next"], lmm["state"], lmm["convs"], cache["attn_convs"])
        if last_kv is None:  # ends on a segment boundary: the next segment starts empty
            retrieval, kv = state.theta, cache["kv"]
        else:
            retrieval = before[0].theta
            kv = tuple(jnp.pad(z.astype(buf.dtype), ((0, 0), (0, c - z.shape[1]), (0, 0), (0, 0)))
                       for z, buf in zip(last_kv, cache["kv"]))
        return out, {"retrieval": retrieval, "lmm": {"convs": convs, "state": state}, "attn_convs": attn_convs,
                     "kv": kv, "next": cache["next"] + t}, jnp.mean(costs)

    def _decode(self, x_BTD, cache):
        """Decoding (and train.state_passing's forward) sows the memory's mean write cost as `_forward` does."""
        if x_BTD.shape[1] == 1:
            out, cache, cost = self._step(x_BTD, cache)
        else:
            def by_tokens(x, cache):
                def body(cache, x_t):
                    out, cache, cost = self._step(x_t[:, None], cache)
                    return cache, (out[:, 0], cost)

                cache, (out, costs) = lax.scan(body, cache, jnp.moveaxis(x, 1, 0))
                return jnp.moveaxis(out, 0, 1), cache, jnp.mean(costs)

            out, cache, cost = lax.cond(cache["next"] % self.segment_len == 0, self._prefill, by_tokens, x_BTD, cache)
        if self.lmm.record_writes:
            self.sow(nnx.Intermediate, "sown_write_cost", cost)
        return out, cache


# ----------------------------------------------------------------------------------------------
# MAG and MAL


class MAGMixer(nnx.Module):
    """Memory as a gate (Titans eqs. 26-28): sliding-window attention over `[persistent ‖ x]`
    (window `model.window`) and the LMM over x run in parallel, each RMS-normalised per head with a
    learned scale (the LMM's read by its output norm), then combined and projected by W_o:

      `model.mag_output="gate"` (eq. 28, `o = y ⊗ M(x)`): `o = (RMSNorm(attn) ⊙ σ(RMSNorm(LMM))) W_o`,
        the attention output gated by the memory's normalised read;
      `"blend"`: `o = (g ⊙ RMSNorm(attn) + (1 - g) ⊙ RMSNorm(LMM)) W_o`, g = σ(x W_g), a learned
        convex blend of the two branches.

    The paper also feeds the persistent tokens through the memory (x̃ = [p ‖ x]); here they are
    attention entries only: the memory's learned initial weights already play the part of a
    learned, input-independent prefix for the LMM (the same holds for MAL)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.num_heads, self.head_dim = cfg.num_heads, head_dim(cfg)
        width = self.num_heads * self.head_dim
        self.combine = mag_output(cfg)
        self.attn = _attention(cfg, window=cfg.window, out_proj=False, rngs=rngs)
        self.lmm = NeuralMemoryMixer(cfg, output=False, rngs=rngs)
        self.attn_norm = RMSNorm(self.head_dim, eps=cfg.norm_eps, axes=("kv",), rngs=rngs)
        self.gate = (Dense(cfg.d_model, width, axes=("embed", "heads"), bias=True, std=cfg.init_std, rngs=rngs)
                     if self.combine == "blend" else None)
        self.o = Dense(width, cfg.d_model, axes=("heads", "embed"),
                       std=cfg.init_std / math.sqrt(2 * cfg.num_layers), rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return {"attn": self.attn.init_cache(batch, max_len, dtype), "lmm": self.lmm.init_cache(batch, max_len, dtype)}

    def inner_losses(self, x_BTD, cache):
        """The LMM's inner loss before and after each write (`MemoryMixer.inner_losses`)."""
        return self.lmm.inner_losses(x_BTD, cache["lmm"])

    def __call__(self, x_BTD, cache=None):
        b, t, _ = x_BTD.shape
        a, attn_cache = self.attn.heads(x_BTD, None if cache is None else cache["attn"])
        m, lmm_cache = self.lmm.heads(x_BTD, None if cache is None else cache["lmm"])
        a, m = self.attn_norm(a), m.astype(a.dtype)
        if self.combine == "gate":
            mixed = a * jax.nn.sigmoid(m)
        else:
            g = jax.nn.sigmoid(self.gate(x_BTD)).reshape(b, t, self.num_heads, self.head_dim)
            mixed = g * a + (1.0 - g) * m
        y = self.o(mixed.reshape(b, t, -1))
        return y, (None if cache is None else {"attn": attn_cache, "lmm": lmm_cache})


class MALMixer(nnx.Module):
    """Memory as a layer (Titans eqs. 29-31): the LMM, then sliding-window attention over
    `[persistent ‖ ·]`, with u = LMM(x) (x is the block's normalised input; the block adds o to the
    residual stream, then its MLP):

      `model.mal_attn_input="m"` (eq. 31, `o = SW-Attn(M(x))`): `o = Attn(RMSNorm(u))`, attention
        on the memory's output alone;
      `"x+m"`: `o = u + Attn(RMSNorm(x + u))`, the LMM and attention as two pre-norm residual
        sub-layers (an extra residual around the memory: attention also sees x)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.attn_input = mal_attn_input(cfg)
        self.lmm = NeuralMemoryMixer(cfg, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = _attention(cfg, window=cfg.window, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype=jnp.float32):
        return {"lmm": self.lmm.init_cache(batch, max_len, dtype), "attn": self.attn.init_cache(batch, max_len, dtype)}

    def inner_losses(self, x_BTD, cache):
        """The LMM's inner loss before and after each write (`MemoryMixer.inner_losses`)."""
        return self.lmm.inner_losses(x_BTD, cache["lmm"])

    def __call__(self, x_BTD, cache=None):
        u, lmm_cache = self.lmm(x_BTD, None if cache is None else cache["lmm"])
        paper = self.attn_input == "m"
        a, attn_cache = self.attn(self.attn_norm(u if paper else x_BTD + u), None if cache is None else cache["attn"])
        return (a if paper else u + a), (None if cache is None else {"lmm": lmm_cache, "attn": attn_cache})
