"""Flax NNX building blocks: projections, norms, RoPE, attention, MLPs, memory mixers.

Parameters carry logical axis names (`out_sharding` metadata) and are created unsharded
(`eager_sharding=False`): nlearn places them on the mesh itself, through the config's rules table.
"""
