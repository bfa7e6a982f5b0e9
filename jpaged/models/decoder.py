"""The decoder as pure functions over a parameter pytree, with layers stacked for `lax.scan`.

Parameters are nested dicts of arrays; every leaf under "layers" has a leading [num_layers] axis,
so one scanned layer body is traced once and compile time stays flat for 40- or 96-layer presets.
Attention is injected (`attend`), so the dense reference and the paged step share every other line.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.models import layers
from jpaged.models.presets import OPT_POSITION_OFFSET, ModelSpec

Params = dict[str, Any]
# attend(cache, layer_index, q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) -> (out [..., Hq, D], cache)
Attend = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def param_shapes(spec: ModelSpec) -> Params:
    """The shape of every parameter, as a pytree of tuples with the layout `init_params` produces."""
    h, f, n = spec.hidden_size, spec.intermediate_size, spec.num_layers
    bias = spec.family == "opt"  # OPT has biases on every projection; LLaMA on none

    def lin(i: int, o: int) -> dict:
        return {"kernel": (n, i, o), "bias": (n, o)} if bias else {"kernel": (n, i, o)}

    def nrm(stack: tuple[int, ...]) -> dict:
        return {"scale": (*stack, h), "bias": (*stack, h)} if bias else {"scale": (*stack, h)}

    block = {"attn_norm": nrm((n,)), "q": lin(h, spec.q_size), "k": lin(h, spec.kv_size),
             "v": lin(h, spec.kv_size), "o": lin(spec.q_size, h), "mlp_norm": nrm((n,))}
    if spec.family == "opt":
        block |= {"fc1": lin(h, f), "fc2": lin(f, h)}
    else:
        block |= {"gate": lin(h, f), "up": lin(h, f), "down": lin(f, h)}
    shapes: Params = {"embed": {"embedding": (spec.vocab_size, h)}, "layers": block, "final_norm": nrm(())}
    if spec.family == "opt":
        shapes["pos_embed"] = {"embedding": (spec.max_position_embeddings + OPT_POSITION_OFFSET, h)}
    if not spec.tie_word_embeddings:
        shapes["lm_head"] = {"kernel": (h, spec.vocab_size)}
    return shapes


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def init_params(spec: ModelSpec, seed: int = 0, dtype: Any = jnp.float32) -> Params:
    """Random, seeded parameters (vLLM's "dummy" load format, and the start of training).

    Weights ~ N(0, 0.02), biases 0, norm scales 1 — the GPT-2/OPT initialisation.
    """
    shapes = param_shapes(spec)
    paths, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(jax.random.key(seed), len(paths))
    leaves = []
    for (path, shape), key in zip(paths, keys):
        name = path[-1].key
        if name == "scale":
            leaves.append(jnp.ones(shape, dtype))
        elif name == "bias":
            leaves.append(jnp.zeros(shape, dtype))
        else:
            leaves.append((0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def embed(spec: ModelSpec, params: Params, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """Token (+ learned position, OPT) embeddings: tokens, positions [...] -> [..., H]."""
    h = params["embed"]["embedding"][tokens]
    if spec.family == "opt":
        h = h + params["pos_embed"]["embedding"][positions + OPT_POSITION_OFFSET]
    return h


def run_layers(spec: ModelSpec, params: Params, h: jax.Array, positions: jax.Array,
               cache: Any, attend: Attend) -> tuple[jax.Array, Any]:
    """All pre-norm decoder blocks via `lax.scan`: h [..., H] -> ([..., H], cache).

    `cache` is carried through the scan (the paged step carries the whole stacked KV pool and
    updates layer `i` in place); `attend` gets the layer index to find its slice.
    """

    def block(carry, xs):
        h, cache = carry
        p, i = xs
        q, k, v = layers.qkv(spec, p, layers.norm(spec, p["attn_norm"], h), positions)
        a, cache = attend(cache, i, q, k, v)
        h = h + layers.attn_out(spec, p, a)
        h = h + layers.mlp(spec, p, layers.norm(spec, p["mlp_norm"], h))
        return (h, cache), None

    xs = (params["layers"], jnp.arange(spec.num_layers, dtype=jnp.int32))
    (h, cache), _ = jax.lax.scan(block, (h, cache), xs)
    return h, cache


def lm_logits(spec: ModelSpec, params: Params, h: jax.Array) -> jax.Array:
    """Final norm and LM head: h [..., H] -> float32 logits [..., V]."""
    h = layers.norm(spec, params["final_norm"], h)
    if spec.tie_word_embeddings:
        logits = h @ params["embed"]["embedding"].T
    else:
        logits = h @ params["lm_head"]["kernel"]
    return logits.astype(jnp.float32)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Dense causal attention with GQA: q [B, L, Hq, D], k/v [B, L, Hkv, D] -> [B, L, Hq, D]."""
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, length, hkv, hq // hkv, d)  # query heads grouped by the KV head they read
    scores = jnp.einsum("blhgd,bmhd->bhglm", qg, k, preferred_element_type=jnp.float32) * scale
    mask = jnp.tril(jnp.ones((length, length), dtype=bool))  # [L, L]
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhglm,bmhd->blhgd", probs, v)
    return out.reshape(b, length, hq, d)


def dense_forward(spec: ModelSpec, params: Params, tokens: jax.Array) -> jax.Array:
    """Full-sequence forward without any cache: tokens i32[B, L] -> float32 logits [B, L, V].

    The reference for the paged step, the training forward, and the engine's dense-cache check.
    """
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    scale = layers.softmax_scale(spec)

    def attend(cache, i, q, k, v):
        return causal_attention(q, k, v, scale), cache

    h, _ = run_layers(spec, params, embed(spec, params, tokens, positions), positions, None, attend)
    return lm_logits(spec, params, h)


def param_count(params: Params) -> int:
    """Number of scalars in a parameter pytree (compare with `ModelSpec.num_params`)."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
