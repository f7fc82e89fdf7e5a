"""Building the train state on a mesh: abstract shapes, shardings by rules, sharded init, restore."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from nlearn import models
from nlearn.train import mesh as mesh_lib
from nlearn.train import state_passing
from nlearn.train.optim import make_optimizer

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class Setup:
    """Everything the trainer, evaluator and generator share about a config on a mesh."""

    config: object
    mesh: jax.sharding.Mesh
    rules: dict
    graphdef: object
    optimizer: optax.GradientTransformation
    abstract_state: dict  # ShapeDtypeStructs carrying their shardings
    state_shardings: dict
    batch_sharding: NamedSharding
    n_params: int

    @property
    def dtype(self):
        return COMPUTE_DTYPES[self.config.model.dtype]

    def init_state(self) -> dict:
        """Fresh state, created directly in its sharded layout."""
        # XLA's default preset whatever train.cpu_opt_preset says: a speed option must not change the
        # initial parameters, and the fast-compile preset rounds the normal sampler differently.
        return jax.jit(lambda: _init_state(self.config, self.optimizer),
                       out_shardings=self.state_shardings)()

    def fresh_carry(self, params):
        """train.state_passing's carried states as a fresh run starts them (the model's initial state per
        row), for `params`."""
        return jax.jit(lambda p: _fresh_carry(nnx.merge(self.graphdef, p), self.config.train),
                       out_shardings=self.state_shardings["carry"])(params)

    def put_batch(self, batch: dict) -> dict:
        """Process-local numpy batch -> global arrays split along the batch axes."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(v))
                for k, v in batch.items()}


def _init_state(config, optimizer) -> dict:
    model = models.build(config)
    # Strong dtypes: a weak-typed leaf (a parameter set from a Python scalar) comes back strong from
    # the first step, and the changed input type recompiles the jitted train step once more.
    params = jax.tree.map(lambda x: x.astype(x.dtype) if x.weak_type else x,
                          nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    state = {"params": params, "opt_state": optimizer.init(params),
             "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.key_data(jax.random.key(config.train.seed))}
    if state_passing.enabled(config):  # the rows' carried states
        state["carry"] = _fresh_carry(model, config.train)
    return state


def _fresh_carry(model, train):
    """One float32 initial decoding state per row of the global batch."""
    return jax.tree.map(lambda x: x.astype(jnp.float32), model.init_cache(train.batch_size, train.seq_len))


def make_setup(config, devices=None) -> Setup:
    """The setup of `config` on all devices, or on `devices` (a TPU topology's, to compile for it)."""
    mesh = mesh_lib.make_mesh(config, devices)
    rules = mesh_lib.rules_table(config)
    optimizer = make_optimizer(config)
    abstract_model = nnx.eval_shape(lambda: models.build(config))
    graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
    logical = nnx.to_pure_dict(nnx.get_partition_spec(abstract_params))
    abstract = jax.eval_shape(lambda: _init_state(config, optimizer))
    param_sh = mesh_lib.param_shardings(abstract["params"], logical, rules, mesh)
    rep = mesh_lib.replicated(mesh)
    opt_sh = optax.tree_map_params(optimizer, lambda _, sh: sh, abstract["opt_state"], param_sh,
                                   transform_non_params=lambda _: rep,
                                   is_leaf=lambda x: isinstance(x, NamedSharding))
    shardings = {"params": param_sh, "opt_state": opt_sh, "step": rep, "rng": rep}
    if "carry" in abstract:  # small (a recurrent state per row); replicated, whatever splits the batch
        shardings["carry"] = jax.tree.map(lambda _: rep, abstract["carry"])
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["params"]))
    return Setup(config, mesh, rules, graphdef, optimizer, abstract, shardings,
                 mesh_lib.batch_sharding(mesh, rules), n_params)
