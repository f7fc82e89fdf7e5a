"""Checkpointer: a second save of the same step (a stop signal right after a periodic save) is a no-op."""

import jax.numpy as jnp

from nlearn.train.checkpoint import Checkpointer


def test_second_save_of_a_step_is_skipped(tmp_path):
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    state = {"w": jnp.arange(3.0)}
    ckpt.save(5, state, None, {"note": "first"})
    ckpt.save(5, {"w": jnp.zeros(3)}, None, {"note": "second"}, force=True)
    ckpt.wait()
    assert ckpt.steps() == [5]
    step, restored, meta = ckpt.restore({"w": jnp.zeros(3)})
    assert step == 5 and meta["note"] == "first"
    assert jnp.array_equal(restored["w"], jnp.arange(3.0))
    ckpt.close()
