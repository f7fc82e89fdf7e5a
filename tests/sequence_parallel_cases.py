"""Sequence parallelism on 4 host CPU devices (`mesh.sequence=4`); collected only by
`tests/test_sequence_parallel.py`, which runs this file in a child process with
`XLA_FLAGS=--xla_force_host_platform_device_count=4` (the flag must be set before jax is imported).

Every split path is compared with the single-device run: outputs, final states and gradients
(float32, relative <= 1e-4), with shards of 25 tokens so that every split falls mid-chunk and the
length divides no chunk size.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from nlearn import models
from nlearn.layers.conv import causal_conv, causal_conv_over_sequence
from nlearn.memory import sequence_parallel as sp
from nlearn.memory.delta import delta_rule, gated_delta_rule
from nlearn.memory.linear_attention import linear_attention
from nlearn.train import mesh as mesh_lib
from nlearn.train.step import token_losses
from run_helpers import load_family_config

DEVICES = 4
B, T, H, D = 2, DEVICES * 25, 2, 8
TOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == DEVICES, "run through tests/test_sequence_parallel.py (4 host devices)"
    return jax.make_mesh((1, DEVICES), ("data", "sequence"), axis_types=(AxisType.Auto,) * 2)


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))


def assert_trees_close(got, want, what: str):
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert a.shape == b.shape and rel(a, b) <= TOL, f"{what}[{i}]: relative error {rel(a, b):.2e}"


def inputs(seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 6)
    q, k, v = (jax.random.normal(kk, (B, T, H, D)) for kk in ks[:3])
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    log_decay = -0.3 * jax.nn.softplus(jax.random.normal(ks[4], (B, T, H)))
    s0 = 0.1 * jax.random.normal(ks[5], (B, H, D, D))
    return q, k, v, beta, log_decay, s0


def value_and_grads(op, args, initial_state, **kw):
    """Outputs, final state and the gradients of a loss reading both, w.r.t. inputs and initial state."""

    def loss(args, s0):
        o, s = op(*args, initial_state=s0, **kw)
        return sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves((o, s))), (o, s)

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(args, initial_state)
    return out, grads


CASES = {  # op name -> (single-device op, arguments from `inputs`, keyword arguments)
    "delta_rule": (delta_rule, lambda q, k, v, b, g: (q, k, v, b), {"chunk_size": 8}),
    "gated_delta_rule": (gated_delta_rule, lambda q, k, v, b, g: (q, k, v, b, g), {"chunk_size": 8}),
    "linear_attention": (linear_attention, lambda q, k, v, b, g: (q, k, v), {"chunk_size": 8}),
}


# The default suite checks the delta rules' fold/scan/finish through the gated_deltanet model below.
@pytest.mark.parametrize("name", ["linear_attention", pytest.param("gated_delta_rule", marks=pytest.mark.slow),
                                  pytest.param("delta_rule", marks=pytest.mark.slow)])
def test_op_matches_single_device(mesh, name):
    op, pick, kw = CASES[name]
    q, k, v, beta, g, s0 = inputs()
    args = pick(q, k, v, beta, g)
    want = value_and_grads(op, args, s0, **kw)
    got = value_and_grads(sp.over_sequence(sp.SHARD_OPS[name], mesh=mesh), args, s0, **kw)
    assert_trees_close(got, want, name)


@pytest.mark.slow
def test_normalized_linear_attention_matches_single_device(mesh):
    q, k, v, *_ = inputs(1)
    q, k = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
    kw = {"chunk_size": 16, "normalize": True}
    want = value_and_grads(linear_attention, (q, k, v), None, **kw)
    got = value_and_grads(sp.over_sequence(sp.linear_attention_shard, mesh=mesh), (q, k, v), None, **kw)
    assert_trees_close(got, want, "normalized linear_attention")


def test_split_refuses_a_length_the_axis_does_not_divide(mesh):
    q, k, v, beta, *_ = inputs()
    with pytest.raises(ValueError, match="T=99 must be divisible by the 'sequence' mesh axis"):
        sp.over_sequence(sp.delta_rule_shard, mesh=mesh)(q[:, :99], k[:, :99], v[:, :99], beta[:, :99])


@pytest.mark.parametrize("kernel,length", [
    (7, 2 * DEVICES),  # shards of 2 tokens: the halo of 6 spans 3 shards, and zeros before the first
    pytest.param(4, T, marks=pytest.mark.slow),
])
def test_conv_halo_matches_single_device(mesh, kernel, length):
    x = jax.random.normal(jax.random.key(3), (B, length, 6))
    w = jax.random.normal(jax.random.key(4), (kernel, 6))

    def loss(conv, x, w):
        return jnp.sum(jnp.sin(conv(x, w))), conv(x, w)

    def single(x, w):
        return causal_conv(jnp.zeros((B, kernel - 1, 6)), x, w)

    split = jax.shard_map(partial(causal_conv_over_sequence, axis_name="sequence"), mesh=mesh,
                          in_specs=(P(None, "sequence"), P()), out_specs=P(None, "sequence"),
                          axis_names={"sequence"})
    want = jax.jit(jax.value_and_grad(partial(loss, single), argnums=(0, 1), has_aux=True))(x, w)
    got = jax.jit(jax.value_and_grad(partial(loss, split), argnums=(0, 1), has_aux=True))(x, w)
    assert_trees_close(got, want, f"conv k={kernel}")


def tiny_model_config(family: str, **memory):
    c = load_family_config(family)
    c.model.update(d_model=16, num_layers=1, num_heads=2)
    if "memory" in c.model:
        c.model.memory.update(chunk_size=8, **memory)
    c.data.vocab_size = 64
    return c


def model_loss_and_grads(config, mesh=None):
    """Mean token loss of a batch and its parameter gradients; split over `mesh`'s sequence axis if given."""
    model = models.build(config)
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, config.data.vocab_size)
    inputs_BT, targets_BT = tokens[:, :-1], tokens[:, 1:]

    def loss(params, inputs_BT, targets_BT):
        return jnp.mean(token_losses(graphdef, params, inputs_BT, targets_BT, jnp.float32))

    step = jax.jit(jax.value_and_grad(loss))
    if mesh is None:
        return step(nnx.to_pure_dict(params), inputs_BT, targets_BT)
    split = NamedSharding(mesh, P("data", "sequence"))
    return mesh_lib.in_mesh_context(step, mesh)(nnx.to_pure_dict(params), jax.device_put(inputs_BT, split),
                                                jax.device_put(targets_BT, split))


@pytest.mark.parametrize("family,data,memory", [
    # data=2 x sequence=2: the batch axis stays with the compiler inside the split; the gates read a conv whose
    # halo crosses the split (memory.gate_conv)
    ("gated_deltanet", 2, {"gate_conv": True}),
    pytest.param("deltanet", 1, {}, marks=pytest.mark.slow),
    pytest.param("linear_attention", 1, {}, marks=pytest.mark.slow),
    pytest.param("transformer", 1, {}, marks=pytest.mark.slow),
])
def test_model_matches_single_device(family, data, memory):
    mesh = jax.make_mesh((data, DEVICES // data), ("data", "sequence"), axis_types=(AxisType.Auto,) * 2)
    config = tiny_model_config(family, **memory)
    assert_trees_close(model_loss_and_grads(config, mesh), model_loss_and_grads(config), family)


def test_nonlinear_memory_refuses_a_split_sequence(mesh):
    with pytest.raises(ValueError, match="nonlinear and cannot split a sequence"):
        model_loss_and_grads(tiny_model_config("titans_lmm"), mesh)
