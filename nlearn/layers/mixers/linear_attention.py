"""`LinearAttentionMixer`: linear attention (`nlearn.memory.linear_attention`) as a token mixer."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.layers.mixers.base import MemoryMixer
from nlearn.memory import sequence_parallel as sp
from nlearn.memory.linear_attention import LinearAttentionState, linear_attention, linear_attention_step


class LinearAttentionMixer(MemoryMixer):
    """Katharopoulos et al.: elu+1 features, `S += k^T v`, optional normalizer."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.normalize = cfg.memory.normalize

    def featurize(self, q, k, v):
        return jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0, v

    def initial_state(self, batch):
        s = jnp.zeros((batch, self.num_heads, self.head_dim, self.head_dim), jnp.float32)
        if not self.normalize:
            return s
        return LinearAttentionState(s, jnp.zeros((batch, self.num_heads, self.head_dim), jnp.float32))

    def sequence_op(self):
        return partial(sp.linear_attention_shard, normalize=self.normalize, chunk_size=self.chunk_size)

    def memory(self, q, k, v, gates, state):
        if q.shape[1] == 1 and state is not None:
            o, state = linear_attention_step(q[:, 0], k[:, 0], v[:, 0], state, normalize=self.normalize)
            return o[:, None], state
        return linear_attention(q, k, v, normalize=self.normalize, initial_state=state,
                                    chunk_size=self.chunk_size)
