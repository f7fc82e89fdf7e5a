"""Sequence parallelism for the affine memories: one sequence's tokens split over a mesh axis.

Linear attention, the delta rule and the gated delta rule carry a state whose update over any
stretch of tokens is an affine map `S -> A S + B` (per batch and head; `A [Dk,Dk]` depends only on
k, β and the decay, `B [Dk,Dv]` is the stretch's state from zero). Each device holding a shard of
the tokens therefore works in three steps:

1. fold its shard into its summary `(A, B)` (for the delta rules the WY product: the existing chunked
   op run on values `[0 | v]` from the state `[I | 0]` leaves `[A | B]`, since every column of the
   state evolves on its own; for linear attention `A = I` and `B = Σ kᵀv`),
2. get its incoming state from the summaries of the devices before it,
3. finish its outputs with the existing chunked op from that incoming state (`initial_state=`).

Step 2 is a log-depth inclusive scan (Hillis-Steele) with `ppermute`: ⌈log2 P⌉ rounds in which
device j composes its map with the one of device j − d (d = 1, 2, 4, ...), then one shift by a device.
A chain (device j waits for j − 1) would need P − 1 dependent hops; an all-gather of the summaries
would move and keep P summaries per device and fold them one after another. The summaries are small
(`Dk × (Dk + Dv)` per head, independent of the shard length) and composing two costs one `Dk³`
matmul per head, so the scan's extra ⌈log2 P⌉ compositions are negligible next to the shard's own
work and its latency grows with log P instead of P.

The DGD input-layer update (a linear memory under `optimizer="dgd"`, mini-batch 1:
`W_t = ((1 − α_t) I − c η_t kᵀk) W_{t-1} + η_t kᵀv`, c = 2 for `l2`, 1 for `dot`) is a gated delta
rule with `a = 1 − α`, `β = c η / a` and values `v a / c`, so `gated_delta_rule_shard` splits it the
same way (the Titans layers do not route it here: they refuse like the other neural memories). The
nonlinear memories (TTT, Titans' deep memory, self-referential Titans) have no such summary; the
layers refuse to split them.

Functions named `*_shard` run inside `jax.shard_map` on per-device `[B, T/P, ...]` shards and name
the mesh axis; `over_sequence` wraps one for global arrays.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nlearn.memory.delta import delta_rule, gated_delta_rule
from nlearn.memory.linear_attention import HIGHEST, LinearAttentionState, linear_attention

SEQUENCE_AXIS = "sequence"


def context_axis_size(axis_name: str = SEQUENCE_AXIS) -> int:
    """Size of `axis_name` in the mesh set by `jax.set_mesh` (1 without such a mesh or axis): the
    layers split sequences when it is > 1."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get(axis_name, 1)


def halo(x_BTC, width: int, axis_name: str):
    """The previous shard's last `width` tokens `[B, width, C]` (zeros on the first device): what a
    causal conv of `width + 1` taps reads across the shard boundary. `width` may exceed a shard."""
    n = jax.lax.axis_size(axis_name)
    b, t, c = x_BTC.shape
    parts, need = [], width
    for hop in range(1, n):  # the tail may span several earlier shards when shards are short
        if need <= 0:
            break
        take = min(need, t)
        # ppermute leaves zeros on the devices that receive nothing (the first `hop` ones)
        parts.insert(0, jax.lax.ppermute(x_BTC[:, t - take:], axis_name, [(j, j + hop) for j in range(n - hop)]))
        need -= take
    past = jnp.concatenate(parts, axis=1) if parts else jnp.zeros((b, 0, c), x_BTC.dtype)
    if need > 0:  # more than all earlier shards hold: zeros, as before the first token
        past = jnp.concatenate([jnp.zeros((b, need, c), x_BTC.dtype), past], axis=1)
    return past


def device_scan(summary, compose, axis_name: str):
    """Inclusive scan of the devices' summaries: device j gets those of devices 0..j composed.

    `summary` is a pytree; `compose(later, earlier)` combines two consecutive stretches. Returns the
    scanned pytree and the device's index. Log-depth by `ppermute` (see the module docstring); the
    callers shift the result by one device to get each device's incoming state.
    """
    n, idx = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    x, hop = summary, 1
    while hop < n:
        recv = jax.lax.ppermute(x, axis_name, [(j, j + hop) for j in range(n - hop)])
        joined = compose(x, recv)
        x = jax.tree.map(lambda a, b: jnp.where(idx >= hop, a, b), joined, x)
        hop *= 2
    return x, idx


def _shift(tree, axis_name: str):
    """Device j gets device j − 1's value; the first device gets zeros."""
    n = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(tree, axis_name, [(j, j + 1) for j in range(n - 1)])


def _last(tree, axis_name: str):
    """The last device's value on every device (the sequence's final state)."""
    n, idx = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    return jax.tree.map(lambda x: jax.lax.psum(jnp.where(idx == n - 1, x, 0), axis_name), tree)


def _affine_compose(later, earlier):
    """`(A2, B2) ∘ (A1, B1) = (A2 A1, A2 B1 + B2)` on `[B,H,Dk,Dk]`, `[B,H,Dk,Dv]` maps."""
    a2, b2 = later
    a1, b1 = earlier
    mm = partial(jnp.einsum, precision=HIGHEST)
    return mm("bhij,bhjk->bhik", a2, a1), mm("bhij,bhjv->bhiv", a2, b1) + b2


def _delta_shard(run, q, k, v, beta, gates, initial_state, axis_name):
    """The delta rules over a shard: fold `[A | B]`, scan the maps, finish from the incoming state."""
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    idx = jax.lax.axis_index(axis_name)
    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    # Columns [I | S0 on the first device, else 0] with values [0 | v] end as [A | A S0 + B].
    start = jnp.concatenate([jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, h, dk, dk)),
                             jnp.where(idx == 0, s0, 0.0)], axis=-1)
    v_ext = jnp.concatenate([jnp.zeros(v.shape[:-1] + (dk,), v.dtype), v], axis=-1)
    _, folded = run(jnp.zeros_like(k), k, v_ext, beta, *gates, initial_state=start)
    summary = (folded[..., :dk], folded[..., dk:])
    (_, state_after), idx = device_scan(summary, _affine_compose, axis_name)
    s_in = jnp.where(idx == 0, s0, _shift(state_after, axis_name))
    o, s_out = run(q, k, v, beta, *gates, initial_state=s_in)
    return o, _last(s_out, axis_name)


def delta_rule_shard(q, k, v, beta, *, axis_name: str, initial_state=None, **op_kwargs):
    """`delta_rule` over this device's shard of the sequence (inside `shard_map`): returns its
    outputs `[B, T/P, H, Dv]` and the sequence's final state (the same on every device)."""
    return _delta_shard(partial(delta_rule, **op_kwargs), q, k, v, beta, (), initial_state, axis_name)


def gated_delta_rule_shard(q, k, v, beta, log_decay, *, axis_name: str, initial_state=None, **op_kwargs):
    """`gated_delta_rule` over this device's shard (see `delta_rule_shard`)."""
    return _delta_shard(partial(gated_delta_rule, **op_kwargs), q, k, v, beta, (log_decay,), initial_state,
                        axis_name)


def linear_attention_shard(q, k, v, *, axis_name: str, normalize: bool = False, initial_state=None, **op_kwargs):
    """`linear_attention` over this device's shard: the summaries are sums (`A = I`), so the scan
    adds them. Returns the shard's outputs and the sequence's final state."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    idx = jax.lax.axis_index(axis_name)
    s_sum = jnp.einsum("bthk,bthv->bhkv", f32(k), f32(v), precision=HIGHEST)
    summary = (s_sum, jnp.sum(f32(k), axis=1)) if normalize else (s_sum,)
    if initial_state is not None:  # the first device starts from it
        s0 = tuple(initial_state) if normalize else (initial_state,)
        summary = tuple(x + jnp.where(idx == 0, f32(x0), 0.0) for x, x0 in zip(summary, s0))
    add = lambda later, earlier: tuple(a + b for a, b in zip(later, earlier))  # noqa: E731
    after, idx = device_scan(summary, add, axis_name)
    s_in = _shift(after, axis_name)
    if initial_state is not None:
        s_in = tuple(jnp.where(idx == 0, f32(x0), x) for x, x0 in zip(s_in, s0))
    s_in = LinearAttentionState(*s_in) if normalize else s_in[0]
    o, s_out = linear_attention(q, k, v, normalize=normalize, initial_state=s_in, **op_kwargs)
    return o, _last(s_out, axis_name)


SHARD_OPS = {"linear_attention": linear_attention_shard, "delta_rule": delta_rule_shard,
             "gated_delta_rule": gated_delta_rule_shard}


def over_sequence(shard_op, *, mesh=None, axis_name: str = SEQUENCE_AXIS):
    """A `*_shard` op as a function of global arrays whose time axis (1) is split over `axis_name`.

    `fn(*arrays, initial_state=None, **op_kwargs) -> (o, final_state)`; the arrays are `[B, T, ...]`
    with T divisible by the axis size; `mesh` None takes the mesh set by `jax.set_mesh`. Only
    `axis_name` is manual inside, so other mesh axes (e.g. the batch's) stay with the compiler.
    """

    def fn(*arrays, initial_state=None, **op_kwargs):
        size = (mesh if mesh is not None else jax.sharding.get_abstract_mesh()).shape[axis_name]
        t = arrays[0].shape[1]
        if t % size:
            raise ValueError(f"sequence length T={t} must be divisible by the '{axis_name}' mesh axis ({size})")
        body = lambda s0, *xs: shard_op(*xs, axis_name=axis_name, initial_state=s0, **op_kwargs)  # noqa: E731
        seq = P(None, axis_name)
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(),) + (seq,) * len(arrays), out_specs=(seq, P()),
                               axis_names={axis_name})
        return mapped(initial_state, *arrays)

    return fn
