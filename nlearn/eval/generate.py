"""Sampling with temperature and top-k, feeding the model's decoding cache one token at a time.

Attention layers keep a (bounded) KV ring buffer and memory layers their recurrent state, so the
work and memory per generated token do not grow with the stream for windowed/recurrent models.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def sample_logits(logits_BV, rng, temperature: float, top_k: int):
    """Greedy when temperature == 0; otherwise softmax(logits / T) restricted to the top k."""
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1)
    logits_BV = logits_BV / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth, -jnp.inf, logits_BV)
    return jax.random.categorical(rng, logits_BV, axis=-1)


def make_decoder(graphdef):
    """Jitted `(params, tokens [B, T], cache) -> (last logits [B, V], cache)`."""

    @jax.jit
    def decode(params, tokens_BT, cache):
        logits, cache = nnx.merge(graphdef, params).decode(tokens_BT, cache)
        return logits[:, -1], cache

    return decode


def generate(graphdef, params, prompt_ids: list[int], *, max_new_tokens: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0, eos_id: int | None = None) -> list[int]:
    """Continue `prompt_ids` (batch of one); returns only the new token ids."""
    model = nnx.merge(graphdef, params)
    cache = model.init_cache(1, len(prompt_ids) + max_new_tokens)
    decode = make_decoder(graphdef)
    logits, cache = decode(params, jnp.asarray([prompt_ids], jnp.int32), cache)
    rng, out = jax.random.key(seed), []
    for _ in range(max_new_tokens):
        rng, key = jax.random.split(rng)
        token = int(sample_logits(logits, key, temperature, top_k)[0])
        if eos_id is not None and token == eos_id:
            break
        out.append(token)
        logits, cache = decode(params, jnp.asarray([[token]], jnp.int32), cache)
    return out
