"""Flax NNX decoders (OPT, LLaMA families), presets, paged model runner and the tiny copy task.

Import submodules directly (`jpaged.models.presets` needs no jax; the others do).
"""
