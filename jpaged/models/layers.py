"""Stateless building blocks of the OPT and LLaMA decoders, over plain parameter dicts.

Every function works on arbitrary leading dimensions ([..., H]), so the same code serves the dense
reference ([B, L, H]) and the paged step ([T, H]). Norm statistics and softmax run in float32 and
are cast back, so bfloat16/float16 models keep their accuracy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jpaged.models.presets import ModelSpec


def linear(p: dict, x: jax.Array) -> jax.Array:
    """x @ kernel (+ bias): p["kernel"] [in, out], optional p["bias"] [out]; x [..., in] -> [..., out]."""
    y = x @ p["kernel"]
    return y + p["bias"] if "bias" in p else y


def layer_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with scale and bias (OPT); x [..., H]."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["scale"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with a scale (LLaMA); x [..., H]. Like Hugging Face, normalise in float32, cast, then scale."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)
    return y.astype(x.dtype) * p["scale"]


def norm(spec: ModelSpec, p: dict, x: jax.Array) -> jax.Array:
    """The family's normalisation: LayerNorm for OPT, RMSNorm for LLaMA."""
    return layer_norm(p, x, spec.norm_eps) if spec.family == "opt" else rms_norm(p, x, spec.norm_eps)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the rotate-half layout of Hugging Face LLaMA weights.

    x [..., heads, D], positions [...] -> [..., heads, D]. Angles are computed in float32 because
    positions reach thousands and bfloat16 angles would be off by whole radians.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [..., 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # [..., heads, D/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def qkv(spec: ModelSpec, p: dict, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Query, key and value heads of one layer (RoPE applied for LLaMA).

    x [..., H] (already normalised), positions [...] ->
    q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D].
    """
    lead = x.shape[:-1]
    q = linear(p["q"], x).reshape(*lead, spec.num_heads, spec.head_dim)
    k = linear(p["k"], x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
    v = linear(p["v"], x).reshape(*lead, spec.num_kv_heads, spec.head_dim)
    if spec.family == "llama":
        q = apply_rope(q, positions, spec.rope_theta)
        k = apply_rope(k, positions, spec.rope_theta)
    return q, k, v


def attn_out(spec: ModelSpec, p: dict, attn: jax.Array) -> jax.Array:
    """Output projection: attn [..., Hq, D] -> [..., H]."""
    return linear(p["o"], attn.reshape(*attn.shape[:-2], spec.q_size))


def mlp(spec: ModelSpec, p: dict, x: jax.Array) -> jax.Array:
    """The family's MLP on normalised x [..., H]: ReLU fc1/fc2 (OPT) or SwiGLU gate/up/down (LLaMA)."""
    if spec.family == "opt":
        return linear(p["fc2"], jax.nn.relu(linear(p["fc1"], x)))
    return linear(p["down"], jax.nn.silu(linear(p["gate"], x)) * linear(p["up"], x))


def softmax_scale(spec: ModelSpec) -> float:
    """1 / sqrt(head_dim), the attention scale of both families."""
    return spec.head_dim ** -0.5
