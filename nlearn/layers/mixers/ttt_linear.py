"""`TTTLinearMixer`: TTT-Linear (`nlearn.memory.ttt`) as a token mixer."""

from __future__ import annotations

from flax import nnx

from nlearn.layers.core import param
from nlearn.layers.mixers.ttt import TTTMixer
from nlearn.memory.ttt import ttt_linear, ttt_linear_init_state, ttt_linear_step


class TTTLinearMixer(TTTMixer):
    """TTT-Linear (Sun et al. 2024): inner model `f(x) = x + LN(x W + b)` trained by mini-batch GD.

    The learned `W0, b0` and the inner LayerNorm's affine are outer-loop parameters; the per-token
    inner rate is `eta = base_lr * sigmoid(x W_eta) / head_dim` (the TTT paper's choice).
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        h, d = self.num_heads, self.head_dim
        self.w0 = param(rngs, (h, d, d), ("heads", None, None), std=cfg.init_std)
        self.b0 = param(rngs, (h, d), ("heads", None), init="zeros")
        self._init_ttt(cfg, rngs)

    def initial_state(self, batch):
        return ttt_linear_init_state(self.w0[...], self.b0[...], batch)

    def memory(self, q, k, v, gates, state):
        (eta,) = gates
        ln = self._ln()
        if state is None:
            return ttt_linear(q, k, v, eta, W0=self.w0[...], b0=self.b0[...], **ln)
        if q.shape[1] == 1:
            o, state = ttt_linear_step(q[:, 0], k[:, 0], v[:, 0], eta[:, 0], state, **ln)
            return o[:, None], state
        return ttt_linear(q, k, v, eta, initial_state=state, **ln)
