"""Device mesh `("data", "fsdp", "tensor", "sequence")` and placement of parameters and batches by rules.

Parameters carry logical axis names; `config.mesh.rules` maps each to mesh axes. A dimension that
a mesh axis does not divide is replicated instead of failing (small models on big meshes). The
`sequence` axis splits each batch's time dimension (sequence parallelism, `nlearn.memory.sequence_parallel`).
"""

from __future__ import annotations

import json
import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from nlearn.errors import UserError
from nlearn.layers.batch_split import axes_size

AXES = ("data", "fsdp", "tensor", "sequence")


def make_mesh(config, devices=None) -> jax.sharding.Mesh:
    """The mesh of `config.mesh` over all devices (or `devices`, e.g. a TPU topology's to compile for);
    one axis may be -1 (the remaining devices)."""
    n = jax.device_count() if devices is None else len(devices)
    sizes = [config.mesh.get(a, 1) for a in AXES]  # configs saved before `mesh.sequence` have none
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise UserError(f"mesh: {dict(zip(AXES, sizes))} does not divide the {n} available devices")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise UserError(f"mesh: data*fsdp*tensor*sequence = {math.prod(sizes)} but {n} devices are available "
                        f"(sizes {dict(zip(AXES, sizes))}; use -1 on one axis to fill)")
    # Auto axes: the compiler propagates shardings from the placed inputs (jax >= 0.10 defaults
    # to Explicit, which would demand sharding-aware code in every op).
    return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def rules_table(config) -> dict:
    return {name: (tuple(axis) if isinstance(axis, list) else axis)
            for name, axis in json.loads(config.mesh.rules)}


def spec_for(shape, logical_axes, rules: dict, mesh) -> P:
    """PartitionSpec of an array whose dims carry `logical_axes` (unknown/indivisible: replicated)."""
    out, used = [], set()
    for dim, name in zip(shape, logical_axes or (None,) * len(shape)):
        axis = rules.get(name) if name is not None else None
        names = axis if isinstance(axis, tuple) else ((axis,) if axis else ())
        if axis is None or dim % axes_size(mesh, axis) or used & set(names):
            out.append(None)
        else:
            out.append(axis)
            used |= set(names)
    return P(*out)


def param_shardings(abstract_state, logical_specs, rules, mesh):
    """NamedShardings for a state pytree, from the logical PartitionSpecs NNX reports."""
    return jax.tree.map(
        lambda x, spec: NamedSharding(mesh, spec_for(x.shape, tuple(spec), rules, mesh)),
        abstract_state, logical_specs, is_leaf=lambda s: isinstance(s, P))


def batch_sharding(mesh, rules) -> NamedSharding:
    """Batches `[B, T]` split over the batch axes, and T over the `sequence` axis when it is > 1."""
    return NamedSharding(mesh, P(rules.get("batch"), "sequence" if sequence_size(mesh) > 1 else None))


def sequence_size(mesh) -> int:
    return dict(mesh.shape).get("sequence", 1)


def in_mesh_context(fn, mesh, batch_sharding: NamedSharding | None = None):
    """`fn` called under `jax.set_mesh(mesh)` when the mesh splits sequences, so the layers trace their
    sequence-parallel form (they read the context mesh), and, given `batch_sharding`, with the model's
    activations kept split as the batch is (nlearn.layers.batch_split)."""
    from nlearn.layers.batch_split import split_like

    if sequence_size(mesh) == 1 and (batch_sharding is None or mesh.size == 1):
        return fn

    def wrapped(*args, **kwargs):
        with split_like(batch_sharding):
            if sequence_size(mesh) == 1:
                return fn(*args, **kwargs)
            with jax.set_mesh(mesh):
                return fn(*args, **kwargs)

    return wrapped


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
