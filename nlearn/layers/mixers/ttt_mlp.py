"""`TTTMLPMixer`: TTT-MLP (`nlearn.memory.ttt_mlp`) as a token mixer."""

from __future__ import annotations

from flax import nnx

from nlearn.layers.core import param
from nlearn.layers.mixers.ttt import TTTMixer
from nlearn.memory.ttt_mlp import ttt_mlp, ttt_mlp_init_state, ttt_mlp_step


class TTTMLPMixer(TTTMixer):
    """TTT-MLP (Sun et al. 2024): inner model `f(x) = x + LN(gelu(x W1 + b1) W2 + b2)`, hidden width
    `expansion * head_dim`, trained by mini-batch GD.

    The learned initial weights (`W1_0, W2_0 ~ N(0, init_std)`, zero biases) and the inner
    LayerNorm's affine are outer-loop parameters; the per-token inner rate is
    `eta = base_lr * sigmoid(x W_eta) / head_dim` (base_lr 0.1 for TTT-MLP in the paper).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        h, d = self.num_heads, self.head_dim
        mem = cfg.memory
        f = mem.expansion * d
        self.w1_0 = param(rngs, (h, d, f), ("heads", None, None), std=cfg.init_std)
        self.b1_0 = param(rngs, (h, f), ("heads", None), init="zeros")
        self.w2_0 = param(rngs, (h, f, d), ("heads", None, None), std=cfg.init_std)
        self.b2_0 = param(rngs, (h, d), ("heads", None), init="zeros")
        self._init_ttt(cfg, rngs)

    def _init_weights(self):
        return dict(W1_0=self.w1_0[...], b1_0=self.b1_0[...], W2_0=self.w2_0[...], b2_0=self.b2_0[...])

    def initial_state(self, batch):
        return ttt_mlp_init_state(*self._init_weights().values(), batch)

    def memory(self, q, k, v, gates, state):
        (eta,) = gates
        ln = self._ln()
        if state is None:
            return ttt_mlp(q, k, v, eta, **self._init_weights(), **ln, inner_step=self.inner_step)
        if q.shape[1] == 1:
            o, state = ttt_mlp_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state, **ln, inner_step=self.inner_step)
            return o[:, None], state
        return ttt_mlp(q, k, v, eta, initial_state=state, **ln, inner_step=self.inner_step)
