"""Keep activations split over the batch the way the batch itself is split.

Sharding propagation alone can lose the batch split: the embedding table is split over `fsdp` along its model
dimension, the token ids over `(data, fsdp)` along the batch, and XLA resolves the lookup by gathering the
ids, so from the embedding on every device computed every sequence of the batch (found compiling for a TPU
topology: a 340m step's logits were `[B, T, V]` per device instead of `[B / n, T, V]`). The train and eval
steps trace under `split_like(batch_sharding)`; the model marks its activations with `constrain`, which is
the identity outside that context (one device, tests, decoding).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

_BATCH = contextvars.ContextVar("nlearn_batch_sharding", default=None)


@contextlib.contextmanager
def split_like(batch_sharding: NamedSharding | None):
    """While tracing inside, `constrain` splits `[B, T, ...]` activations as `batch_sharding` splits `[B, T]`."""
    token = _BATCH.set(batch_sharding)
    try:
        yield
    finally:
        _BATCH.reset(token)


def axes_size(mesh, axes) -> int:
    """Devices along mesh axis `axes` (a name, a tuple of names, or None: 1)."""
    if axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def constrain(x_BT):
    """`x [B, T, ...]` constrained to the batch's split (a dimension the split does not divide stays whole);
    `x` itself outside `split_like` or when the split is trivial."""
    sharding = _BATCH.get()
    if sharding is None or x_BT.ndim < 2 or sharding.mesh.size == 1:
        return x_BT
    axes = [a if dim % axes_size(sharding.mesh, a) == 0 else None
            for dim, a in zip(x_BT.shape[:2], tuple(sharding.spec) + (None,) * 2)]
    if all(a is None for a in axes):
        return x_BT
    return jax.lax.with_sharding_constraint(x_BT, NamedSharding(sharding.mesh, P(*axes)))
