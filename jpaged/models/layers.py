"""One decoder block of the OPT and LLaMA families as a Flax NNX module, and its RoPE.

The block works on arbitrary leading dimensions ([..., H]), so the same code serves the dense
reference ([B, L, H]) and the paged step ([T, H]). Attention itself is injected (`attend`): the
block computes q/k/v and hands them over with the layer's cache, so the dense reference, the paged
step and the static-batching baseline share every other line. Every parameter carries logical axis
names (`out_sharding` metadata, e.g. ("embed", "q_heads")); `jpaged.models.parallel` maps them onto the
device mesh. Norm statistics and RoPE angles are float32 whatever the parameter dtype.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config.presets import ModelSpec

# attend(cache, layer_index, q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) -> (out [..., Hq, D], cache)
Attend = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]

# GPT-2 / OPT initialisation of the dummy weights: N(0, 0.02) matrices, zero biases, unit scales.
WEIGHT_INIT = nnx.initializers.normal(0.02)


def axes(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming each axis of a parameter; the mesh placement comes later (parallel.py)."""
    return {"out_sharding": names, "eager_sharding": False}


def linear(d_in: int, d_out: int, in_axis: str, out_axis: str, *, bias: bool, dtype: Any,
           rngs: nnx.Rngs) -> nnx.Linear:
    """x [..., d_in] @ kernel [d_in, d_out] (+ bias [d_out]), axes named for tensor parallelism.

    The dot reads both operands in the parameter dtype (x is cast to it, the kernel never is) and
    accumulates and returns float32: bfloat16 weights stay bfloat16 in memory and in the dot
    (XLA:CPU's YNNPACK dots take bf16 operands with f32 output; converting the kernel to float32
    instead would convert every weight in every step), while the residual stream stays float32.
    """
    return nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
                  preferred_element_type=jnp.float32, kernel_init=WEIGHT_INIT, rngs=rngs,
                  kernel_metadata=axes(in_axis, out_axis), bias_metadata=axes(out_axis))


def norm(spec: ModelSpec, dtype: Any, rngs: nnx.Rngs) -> nnx.Module:
    """The family's normalisation over H: LayerNorm with a bias (OPT) or RMSNorm (LLaMA)."""
    kwargs = dict(epsilon=spec.norm_eps, use_fast_variance=False, param_dtype=dtype, rngs=rngs,
                  scale_metadata=axes("embed"))
    if spec.family == "opt":
        return nnx.LayerNorm(spec.hidden_size, bias_metadata=axes("embed"), **kwargs)
    return nnx.RMSNorm(spec.hidden_size, **kwargs)


def softmax_scale(spec: ModelSpec) -> float:
    """1 / sqrt(head_dim), the attention scale of both families."""
    return spec.head_dim ** -0.5


def rope_frequencies(spec: ModelSpec) -> np.ndarray:
    """RoPE inverse frequencies f32[head_dim / 2], with the spec's long-context scaling applied."""
    d = spec.head_dim
    inv_freq = 1.0 / spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: wavelengths longer than the pre-training context / low_freq_factor are stretched by
    # `factor`; shorter than context / high_freq_factor are kept; a linear blend in between.
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    blend = (context / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    out = np.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, blended)
    out = np.where(wavelength < context / scaling.high_freq_factor, inv_freq, out)
    return out.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in the rotate-half layout of Hugging Face LLaMA weights.

    x [..., heads, D], positions [...] -> [..., heads, D]. Angles are float32: positions reach
    thousands and bfloat16 angles would be off by whole radians.
    """
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [..., 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [..., heads, D/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class Block(nnx.Module):
    """Pre-norm decoder block: h + attn(norm(h)), then h + mlp(norm(h)).

    OPT: LayerNorm, biased projections, learned positions (added before the first block), ReLU MLP
    fc1/fc2. LLaMA: RMSNorm, no biases, RoPE on q and k, SwiGLU MLP gate/up/down.
    """

    def __init__(self, spec: ModelSpec, *, dtype: Any, rngs: nnx.Rngs):
        h, f, bias = spec.hidden_size, spec.intermediate_size, spec.family == "opt"
        self.spec = spec
        self.attn_norm = norm(spec, dtype, rngs)
        self.q = linear(h, spec.q_size, "embed", "q_heads", bias=bias, dtype=dtype, rngs=rngs)
        self.k = linear(h, spec.kv_size, "embed", "kv_heads", bias=bias, dtype=dtype, rngs=rngs)
        self.v = linear(h, spec.kv_size, "embed", "kv_heads", bias=bias, dtype=dtype, rngs=rngs)
        # Row-split under tensor parallelism: the bias is added once, after the all-reduce.
        self.o = linear(spec.q_size, h, "q_heads", "embed", bias=bias, dtype=dtype, rngs=rngs)
        self.mlp_norm = norm(spec, dtype, rngs)
        if spec.family == "opt":
            self.fc1 = linear(h, f, "embed", "mlp", bias=True, dtype=dtype, rngs=rngs)
            self.fc2 = linear(f, h, "mlp", "embed", bias=True, dtype=dtype, rngs=rngs)
        else:
            self.gate = linear(h, f, "embed", "mlp", bias=False, dtype=dtype, rngs=rngs)
            self.up = linear(h, f, "embed", "mlp", bias=False, dtype=dtype, rngs=rngs)
            self.down = linear(f, h, "mlp", "embed", bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, h: jax.Array, positions: jax.Array, cache: Any, layer: jax.Array,
                 attend: Attend) -> tuple[jax.Array, Any]:
        """h [..., H], positions [...] -> (h [..., H], cache); `attend` reads/writes layer `layer`'s cache."""
        # The named scopes label the compiled ops by part (experiments/bench/profile_forward.py).
        spec, lead = self.spec, h.shape[:-1]
        with jax.named_scope("qkv_proj"):
            x = self.attn_norm(h)
            q = self.q(x).reshape(*lead, spec.num_heads, spec.head_dim)
            k = self.k(x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
            v = self.v(x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
            if spec.family == "llama":
                inv_freq = rope_frequencies(spec)  # a constant of the trace
                q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        with jax.named_scope("attention"):
            a, cache = attend(cache, layer, q, k, v)  # [..., Hq, D]
        with jax.named_scope("out_proj"):
            h = h + self.o(a.reshape(*lead, spec.q_size))
        with jax.named_scope("mlp"):
            return h + self._mlp(self.mlp_norm(h)), cache

    def _mlp(self, x: jax.Array) -> jax.Array:
        if self.spec.family == "opt":
            return self.fc2(jax.nn.relu(self.fc1(x)))
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
