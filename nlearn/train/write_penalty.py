"""`train.write_penalty`: an L1 cost on how strongly a memory writes each token.

Trained on short windows with its loss on an answer, a memory has no reason to leave its state alone over
input it never needs: every filler token's write wears a stored association (a needle) a little, which a
512-token window does not notice and a 16K one does. Charging `write_penalty` times the mean write cost per
layer (the write gate's strength: the delta rules' beta, the Titans and TTT memories' learning rate, the
self-referential memories' layer gate `memory.lr_gate`, which scales a token's whole step;
`nlearn.layers.mixers.base.WRITE_COSTS`) lets the model close its write gate wherever a write does not lower
the loss. With `model.memory.beta_gate="hard_sigmoid"` (`lr_gate` for Titans and TTT) a closed gate is exactly
0, and a token written with strength 0 adds nothing to the state however many follow (a Titans memory still
forgets by its decay gate and moves by its momentum). `train.write_penalty_from` starts the cost at a later
step, once the task is learnt (a gate closed by the cost alone has no gradient to reopen).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from nlearn.errors import UserError

def enabled(config) -> bool:
    return config.train.get("write_penalty", 0.0) > 0


def validate(config) -> None:
    """A UserError naming the setting that cannot be honoured."""
    t = config.train
    weight, first = t.get("write_penalty", 0.0), t.get("write_penalty_from", 0)
    fail = "invalid config value {}={!r}: {}".format
    if weight < 0:
        raise UserError(fail("train.write_penalty", weight, "must be >= 0 (the weight of the mean write cost)"))
    if first < 0:
        raise UserError(fail("train.write_penalty_from", first, "must be >= 0 (a step)"))
    from nlearn import models  # each family's record says whether its memories sow a write cost

    if weight and not models.FAMILIES[config.model.family].write_cost:
        able = sorted(name for name, family in models.FAMILIES.items() if family.write_cost)
        raise UserError(fail("train.write_penalty", weight, f"family {config.model.family!r} has no write gate to "
                             f"charge (only {', '.join(able)})"))
    if weight and config.train.get("state_passing", 0.0) > 0 and not models.FAMILIES[
            config.model.family].decode_write_cost:
        raise UserError(fail("train.write_penalty", weight, f"family {config.model.family!r} reports no write cost "
                             "while decoding, which train.state_passing trains with (set one of them to 0)"))
    if weight and config.model.get("scan_layers", False):
        raise UserError(fail("train.write_penalty", weight, "needs model.scan_layers=False (scanned layers do not "
                             "report their write costs)"))


def run_costed(method, *args):
    """`(method(*args), the sum over layers of the write costs it sowed)`; `method` is a bound method (e.g.
    `model.__call__`, `model.decode`) of a model whose memories are told to sow them.

    Sown values are popped from the model rather than gathered with `nnx.capture`, which fails inside
    `nnx.remat` (model.remat) in flax 0.12; hence the silenced notice that sowing outside it is deprecated."""
    model = method.__self__
    model.set_attributes(record_writes=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*sow.*outside of 'nnx.capture", category=DeprecationWarning)
        out = method(*args)
    return out, sum(jax.tree.leaves(nnx.pop(model, nnx.Intermediate)), jnp.zeros((), jnp.float32))


def weight_at(step, weight: float, first_step: int):
    """The cost's weight at `step` (traced): 0 before `first_step`."""
    return jnp.where(step >= first_step, weight, 0.0).astype(jnp.float32)
