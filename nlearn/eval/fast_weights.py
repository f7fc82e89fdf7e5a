"""The largest norm a model's fast weights reach over one sequence: a memory blowing up shows here before
its loss turns nan (a per-head output RMSNorm hides the scale of what the memory reads until it overflows).

The sequence is prefilled through the model's decode path (`init_cache` then `decode`), and every memory
state left in the cache is measured: a matrix memory's state, a neural memory's weights θ, the
self-referential memories' weights and the CMS levels' in-context change. Attention caches are no fast
weights and are skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.tree_util import DictKey, GetAttrKey

# a state's momentum, chunk-start copies, counters and the current mini-batch's keys (inputs, not weights)
SKIPPED = ("U", "theta_start", "start", "pos", "keys")


def _is_fast_weight(path) -> bool:
    dict_keys = [k.key for k in path if isinstance(k, DictKey)]
    attrs = [k.name for k in path if isinstance(k, GetAttrKey)]
    if any(a in SKIPPED for a in attrs) or "start" in dict_keys:
        return False
    return "state" in dict_keys or "delta" in dict_keys


def frobenius(x):
    """Frobenius norm over the last two axes, in float32 and scaled first, so a large state gives a large
    finite number instead of inf (squares overflow float32 from |x| ~ 1.8e19)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=(-2, -1), keepdims=True)
    safe = jnp.where(scale > 0, scale, 1.0)
    return safe[..., 0, 0] * jnp.sqrt(jnp.sum(jnp.square(x / safe), axis=(-2, -1)))


def max_fast_weight_norm(cache):
    """The largest Frobenius norm of any fast-weight matrix in `cache` (nan if one is not finite, 0 if the
    cache holds none)."""
    norms = [jnp.max(frobenius(leaf)) for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]
             if _is_fast_weight(path) and jnp.ndim(leaf) >= 3 and jnp.issubdtype(leaf.dtype, jnp.floating)]
    if not norms:
        return jnp.zeros((), jnp.float32)
    n = jnp.stack(norms)
    return jnp.where(jnp.all(jnp.isfinite(n)), jnp.max(n), jnp.nan)


def make_fast_weight_norm(setup):
    """`(params, tokens [B, T]) -> float`: the model prefills `tokens` and its fast weights' largest norm."""
    graphdef = setup.graphdef

    @jax.jit
    def run(params, tokens):
        model = nnx.merge(graphdef, params)
        cache = model.init_cache(tokens.shape[0], tokens.shape[1], jnp.float32)
        _, cache = model.decode(tokens, cache)
        return max_fast_weight_norm(cache)

    return lambda params, tokens: float(run(params, tokens))
