# %% [markdown]
# # 01 · Memory lab: the worked examples, computed with nlearn's ops
#
# Every number below is a worked example from the step-by-step derivation of test-time memories
# (linear attention, fast weights, the delta rule, Titans' momentum and forgetting), recomputed with the public ops of
# `nlearn.memory` and checked with an `assert`. The ops use row vectors: a write is `kᵀv`, a read
# is `q S`; inputs are `[B, T, H, D]` (batch, time, heads, width), gates `[B, T, H]`.

# %%
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from nlearn.memory import delta_rule, linear_attention, neural_memory


def seq(*rows):
    """A [1, T, 1, D] sequence (one batch element, one head) from T row vectors."""
    return jnp.asarray(rows, jnp.float32)[None, :, None, :]


def gate(*values):
    """A [1, T, 1] per-token gate."""
    return jnp.asarray(values, jnp.float32)[None, :, None]


def close(a, b, tol=1e-5):
    return np.allclose(np.asarray(a), np.asarray(b), atol=tol)

# %% [markdown]
# ## 1. The normalized read (0.8, 1.8)
#
# Keys `k1 = (1, 1)`, `k2 = (1, 2)`, values `v1 = (2, 0)`, `v2 = (0, 3)`, query `q = (1, 1)`: with the
# dot product as similarity the weights are 2 and 3, so the read is `(2·v1 + 3·v2) / 5 = (0.8, 1.8)`.
# Normalized linear attention gets it from a fixed-size state, `S₂ = k1ᵀv1 + k2ᵀv2` and `c₂ = k1 + k2`.

# %%
k = seq((1, 1), (1, 2))
v = seq((2, 0), (0, 3))
q = seq((1, 1), (1, 1))
o, state = linear_attention(q, k, v, normalize=True)
print("read at t=2:", o[0, 1, 0], "\nS2 =\n", state.S[0, 0], "\nc2 =", state.c[0, 0])
assert close(o[0, 1, 0], (0.8, 1.8))
assert close(state.S[0, 0], [[2, 3], [2, 6]]) and close(state.c[0, 0], (2, 3))
assert close(q[0, 1, 0] @ state.S[0, 0], (4, 9)) and close(q[0, 1, 0] @ state.c[0, 0], 5)

# %% [markdown]
# ## 2. Two writes make the identity
#
# Without the normalizer, the writes `(1,0) ↦ (1,0)` and `(0,1) ↦ (0,1)` from a zero matrix give
# `W₂ = I`: each key selects its own row, and the query `(0.5, 0.5)` mixes them.

# %%
k = seq((1, 0), (0, 1))
v = seq((1, 0), (0, 1))
_, W2 = linear_attention(k, k, v)
print("W2 =\n", W2[0, 0])
assert close(W2[0, 0], np.eye(2))
assert close(jnp.asarray([0.5, 0.5]) @ W2[0, 0], (0.5, 0.5))
# The delta rule with β = 1 writes the same matrix from zero (its keys are orthogonal).
_, W2_delta = delta_rule(k, k, v, gate(1, 1))
assert close(W2_delta, W2)

# %% [markdown]
# ## 3. The delta correction
#
# Now `(1, 0)` should return `(0, 1)`. Adding would make the first row `(1, 1)`; the delta rule writes
# the error instead: prediction `v̂ = (1, 0)`, error `e = v̂ − v = (1, −1)`, and with η = 1
# `W = I − k ᵀe = [[0, 1], [0, 1]]`. The other key still reads `(0, 1)`.

# %%
I = jnp.eye(2)[None, None]  # initial state [B, H, Dk, Dv]
k3, v3 = seq((1, 0)), seq((0, 1))
_, W3 = delta_rule(k3, k3, v3, gate(1.0), initial_state=I)
_, W3_add = linear_attention(k3, k3, v3, initial_state=I)
print("delta:\n", W3[0, 0], "\nadditive:\n", W3_add[0, 0])
assert close(W3[0, 0], [[0, 1], [0, 1]])
assert close(W3_add[0, 0], [[1, 1], [0, 1]])
# The same write as one step of gradient descent on ½‖kW − v‖² (a depth-1 neural memory, plain SGD):
_, (theta, _) = neural_memory(k3, k3, v3, lr=gate(1.0), initial_state=((I,), (jnp.zeros_like(I),)),
                              optimizer="sgd", objective="l2")
assert close(theta[0], W3)
# The error after the write is (1 − η‖k‖²) times the error before: zero for a unit key and η = 1,
# an overshoot for a longer key.
for eta, key in ((1.0, (1, 0)), (0.5, (1, 0)), (1.0, (1.2, 0))):
    kk = seq(key)
    _, W = delta_rule(kk, kk, v3, gate(eta), initial_state=I)
    kvec = jnp.asarray(key, jnp.float32)
    e_old, e_new = kvec @ I[0, 0] - v3[0, 0, 0], kvec @ W[0, 0] - v3[0, 0, 0]
    assert close(e_new, (1 - eta * kvec @ kvec) * e_old)
    print(f"eta={eta}, k={key}: error {np.asarray(e_old)} -> {np.asarray(e_new)}")

# %% [markdown]
# ## 4. Interference from the overlapping key (0.8, 0.6)
#
# A write changes an old query's read by `Δz = η (q·k)(v − v̂)`. The probes `(1, 0)` and `(0, 1)` overlap
# the key `(0.8, 0.6)` by 0.8 and 0.6, so a correct write for that key moves both of them. We write the
# value `(1, 0)` into the corrected memory `W3`.

# %%
k4, v4 = seq((0.8, 0.6)), seq((1, 0))
_, W4 = delta_rule(k4, k4, v4, gate(1.0), initial_state=W3)
probes = jnp.eye(2)
before, after = probes @ W3[0, 0], probes @ W4[0, 0]
v_hat = k4[0, 0, 0] @ W3[0, 0]
expected = (probes @ k4[0, 0, 0])[:, None] * (v4[0, 0, 0] - v_hat)[None, :]
print("probe reads before:\n", before, "\nafter:\n", after)
assert close(probes @ k4[0, 0, 0], (0.8, 0.6))
assert close(after - before, expected)
assert close(k4[0, 0, 0] @ W4[0, 0], v4[0, 0, 0])  # the new key itself reads its value exactly

fig, axes = plt.subplots(1, 2, figsize=(8, 2.6), sharey=True)
for i, ax in enumerate(axes):
    ax.bar(np.arange(2) - 0.2, before[i], width=0.4, label="before the 4th write")
    ax.bar(np.arange(2) + 0.2, after[i], width=0.4, label="after")
    ax.set_xticks([0, 1], ["coordinate 1", "coordinate 2"])
    ax.set_title(f"probe {tuple(int(x) for x in probes[i])}")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## 5. Momentum and forgetting: W = 2, U = 0.2, g = −0.4
#
# Titans keeps a running update `U_t = μ U_{t-1} − η g_t` and forgets `W_t = (1 − α) W_{t-1} + U_t`.
# With `μ = 0.5`, `η = 0.1`, `α = 0.1`: `U = 0.14` and `W = 0.9·2 + 0.14 = 1.94`. A scalar depth-1 memory
# with key 1 and target 2.4 has the gradient `k(kW − v) = 2 − 2.4 = −0.4` at `W = 2`.

# %%
one = seq((1.0,))
W0, U0 = jnp.full((1, 1, 1, 1), 2.0), jnp.full((1, 1, 1, 1), 0.2)
for impl in ("chunked", "recurrent"):
    o, (theta, U) = neural_memory(one, one, seq((2.4,)), lr=gate(0.1), momentum=gate(0.5), decay=gate(0.1),
                                  initial_state=((W0,), (U0,)), optimizer="momentum", impl=impl)
    U1, W1, read1 = (float(x.squeeze()) for x in (U[0], theta[0], o))
    print(f"{impl}: U = {U1:.4f}, W = {W1:.4f}, read = {read1:.4f}")
    assert close(U[0].squeeze(), 0.14) and close(theta[0].squeeze(), 1.94) and close(o.squeeze(), 1.94)

# %% [markdown]
# ## 6. Mini-batches change the schedule
#
# Scalar memory `w₀ = 0`, keys 1, targets 1 then 3, η = 0.5. Fully online: `w₁ = 0.5`, `w₂ = 1.75`. In a
# two-token mini-batch both gradients are taken at `w₀`: `w₂ = 2`, while the first token still reads
# `w₁ = 0.5` (causality holds inside the mini-batch).

# %%
ones, targets = seq((1.0,), (1.0,)), seq((1.0,), (3.0,))
zero = (jnp.zeros((1, 1, 1, 1)),)
for b, expect in ((1, (0.5, 1.75)), (2, (0.5, 2.0))):
    o, _ = neural_memory(ones, ones, targets, lr=gate(0.5, 0.5), initial_state=(zero, zero),
                         optimizer="sgd", minibatch=b)
    print(f"minibatch={b}: reads {np.asarray(o).ravel()}")
    assert close(o.ravel(), expect)

# %% [markdown]
# ## 7. Additive vs delta vs momentum + decay on overlapping keys
#
# A stream of 24 writes cycles through three overlapping keys (unit vectors in 2-D, 40° apart), with
# values that change half-way (the association is corrected). Three heads carry the same stream, and
# head j reads with key j, so one call gives every key's read after every write. The additive memory
# grows without bound and never replaces the old value; the delta rule tracks the corrected values but
# keeps interfering (the keys overlap); momentum + decay smooths the updates and lets old writes fade.

# %%
T = 24
angles = np.deg2rad([0.0, 40.0, 80.0])
keys = np.stack([np.cos(angles), np.sin(angles)], 1).astype(np.float32)  # three unit keys
vals_a = np.array([[1, 0], [0, 1], [1, 1]], np.float32)
vals_b = np.array([[0, 1], [1, 0], [-1, 1]], np.float32)  # corrected values from t = T/2
ks = np.stack([keys[t % 3] for t in range(T)])
vs = np.stack([(vals_a if t < T // 2 else vals_b)[t % 3] for t in range(T)])
# Three heads see the same stream; head j reads with key j's probe, so o[:, t, j] = key_j · W_t.
k_seq = jnp.broadcast_to(jnp.asarray(ks)[None, :, None], (1, T, 3, 2))
v_seq = jnp.broadcast_to(jnp.asarray(vs)[None, :, None], (1, T, 3, 2))
q_seq = jnp.broadcast_to(jnp.asarray(keys)[None, None], (1, T, 3, 2))
g = lambda x: jnp.full((1, T, 3), x)  # noqa: E731
zeros = (jnp.zeros((3, 2, 2)),)
rules = {
    "additive (linear attention)": linear_attention(q_seq, k_seq, v_seq)[0],
    "delta rule (β = 0.8)": delta_rule(q_seq, k_seq, v_seq, g(0.8))[0],
    "momentum + decay (η = 0.5, μ = 0.5, α = 0.1)": neural_memory(
        q_seq, k_seq, v_seq, lr=g(0.5), momentum=g(0.5), decay=g(0.1), weights0=zeros, optimizer="momentum")[0],
}
target = np.stack([(vals_a if t < T // 2 else vals_b) for t in range(T)])  # [T, key, Dv]
errors = {}
fig, axes = plt.subplots(1, 3, figsize=(12, 3), sharey=True)
for ax, (name, reads) in zip(axes, rules.items()):
    err = np.linalg.norm(np.asarray(reads[0]) - target, axis=-1)  # [T, key]
    errors[name] = err
    for j in range(3):
        ax.plot(np.arange(1, T + 1), err[:, j], label=f"key {j + 1}")
    ax.axvline(T // 2 + 0.5, color="gray", ls=":")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("writes")
axes[0].set_ylabel("‖k W − current value‖")
axes[0].legend(fontsize=8)
plt.tight_layout()
plt.show()

final = {name: float(err[-3:].mean()) for name, err in errors.items()}
print({name: round(e, 3) for name, e in final.items()})
# Correction beats accumulation: after the values change, the additive memory keeps the stale sum.
assert final["delta rule (β = 0.8)"] < final["additive (linear attention)"]
assert final["momentum + decay (η = 0.5, μ = 0.5, α = 0.1)"] < final["additive (linear attention)"]
