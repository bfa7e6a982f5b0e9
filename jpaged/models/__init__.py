"""Flax NNX decoders (OPT, LLaMA families), the paged model runner, checkpoints, tensor parallelism
and the tiny copy task. Every module here imports jax; the architecture specs they build from are
configuration (`jpaged.config.presets`).
"""
