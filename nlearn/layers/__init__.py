"""Flax NNX building blocks: projections, norms, RoPE, attention, MLPs, memory mixers.

Parameters carry logical axis names (`out_sharding` metadata). nlearn places them on the mesh
itself, through the config's rules table, so Flax's eager sharding at creation is switched off.
"""

from flax import nnx

nnx.use_eager_sharding(False)
