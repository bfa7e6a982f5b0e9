"""The OPT / LLaMA causal LM as a Flax NNX module, and the pure functions of its state around it.

`CausalLM` holds `embed`, `pos_embed` (OPT), `layers` (one `Block` whose every parameter has a
leading [num_layers] axis: built and applied by `nnx.scan`, so one layer body is traced
and compile time stays flat for 40- or 96-layer presets), `final_norm` and `lm_head` (untied heads
only). Attention is injected (`layers.Attend`) and the cache is carried through the scan and
returned, never stored in the module.

Outside the module, parameters are its Flax state as a pure dict (`nnx.to_pure_dict`), e.g.
`params["layers"]["q"]["kernel"]` f32[L, H, Hq * D]: the tree orbax checkpoints and the Hugging Face
import write, and what jitted steps take. A jitted step is a pure function of that state: it
rebuilds the module with `nnx.merge(graphdef, params)` while tracing (as Flax's gemma sampler does).
Pure dicts rather than `nnx.State` cross the jit boundary because jit flattens them in C++, not
through State's Variable nodes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jpaged.config.presets import OPT_POSITION_OFFSET, ModelSpec
from jpaged.models import layers
from jpaged.models.layers import Attend

Params = dict[str, Any]  # the pure-dict Flax state of a CausalLM


class CausalLM(nnx.Module):
    """Decoder-only transformer with a language-model head (OPT or LLaMA family)."""

    def __init__(self, spec: ModelSpec, *, dtype: Any = jnp.float32, rngs: nnx.Rngs):
        h = spec.hidden_size
        self.spec = spec
        embed_kwargs = dict(param_dtype=dtype, embedding_init=layers.WEIGHT_INIT, rngs=rngs)
        self.embed = nnx.Embed(spec.vocab_size, h, embedding_metadata=layers.axes("vocab", "embed"), **embed_kwargs)
        if spec.family == "opt":
            self.pos_embed = nnx.Embed(spec.max_position_embeddings + OPT_POSITION_OFFSET, h,
                                       embedding_metadata=layers.axes(None, "embed"), **embed_kwargs)

        # Created one layer per scan iteration (not vmapped), so a sharded initialisation needs
        # the random bits of one layer at a time.
        @nnx.split_rngs(splits=spec.num_layers)
        @nnx.scan(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs: nnx.Rngs) -> layers.Block:
            return layers.Block(spec, dtype=dtype, rngs=rngs)

        self.layers = stacked_blocks(rngs)
        self.final_norm = layers.norm(spec, dtype, rngs)
        if not spec.tie_word_embeddings:
            self.lm_head = layers.linear(h, spec.vocab_size, "embed", "vocab", bias=False, dtype=dtype, rngs=rngs)

    def embed_tokens(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Token (+ learned position, OPT) embeddings: tokens, positions [...] -> [..., H]."""
        with jax.named_scope("embed"):
            h = self.embed(tokens).astype(jnp.float32)  # the residual stream is float32 in any dtype
            if self.spec.family == "opt":
                h = h + self.pos_embed(positions + OPT_POSITION_OFFSET)
            return h

    def run_layers(self, h: jax.Array, positions: jax.Array, cache: Any, attend: Attend,
                   blocks: Sequence[layers.Block] | None = None) -> tuple[jax.Array, Any]:
        """All decoder blocks: h [..., H] -> ([..., H], cache).

        Scanned over the stacked `self.layers` by default. `cache` is the scan carry (the paged
        step carries the whole stacked KV pool and writes layer i in place); `attend` gets the
        layer index to find its part. With `blocks` (one `Block` per layer, each over its own
        buffers, see `unstack_layers`) the layers run one after another instead, unrolled in the
        trace: a scan slices layer i out of every stacked weight, which XLA:CPU does as a copy
        (the whole model's weights copied once per step).
        """
        if blocks is not None:
            for i, block in enumerate(blocks):
                h, cache = block(h, positions, cache, i, attend)
            return h, cache

        @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
        def scan_blocks(carry, block: layers.Block, layer: jax.Array):
            h, cache = carry
            return block(h, positions, cache, layer, attend)

        return scan_blocks((h, cache), self.layers, jnp.arange(self.spec.num_layers, dtype=jnp.int32))

    def logits(self, h: jax.Array, head: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
        """Final norm and LM head: h [..., H] -> float32 logits [..., V].

        `head`, when given, is the LM head's multiply in place of the module's own, with its
        semantics (h [..., H] -> float32 [..., V]): the runner passes one over its own copy of a
        tied head's weights (`jpaged.models.packed`).
        """
        with jax.named_scope("lm_head"):
            h = self.final_norm(h)
            if head is not None:
                return head(h)
            if not self.spec.tie_word_embeddings:
                return self.lm_head(h)  # float32 out (layers.linear)
            # Tied: h [..., H] . embedding [V, H]^T in the weights' dtype, accumulated in float32
            # (`nnx.Embed.attend` would promote the embedding to h's float32 every step).
            table = self.embed.embedding[...]
            return jax.lax.dot_general(h.astype(table.dtype), table, (((h.ndim - 1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Full-sequence forward without a cache: tokens i32[B, L] -> float32 logits [B, L, V]."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        scale = layers.softmax_scale(self.spec)

        def attend(cache, layer, q, k, v):
            return causal_attention(q, k, v, scale), cache

        h, _ = self.run_layers(self.embed_tokens(tokens, positions), positions, None, attend)
        return self.logits(h)


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


@functools.lru_cache(maxsize=64)
def abstract_model(spec: ModelSpec, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, abstract state) of `CausalLM(spec, dtype)`, built without allocating a parameter.

    The state's leaves are `nnx.Param`s of `jax.ShapeDtypeStruct`s carrying their logical axis
    names (metadata "out_sharding"); the graphdef turns any pure-dict state back into the module.
    """
    model = nnx.eval_shape(lambda: CausalLM(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


@functools.lru_cache(maxsize=64)
def abstract_block(spec: ModelSpec, dtype: Any = jnp.float32) -> nnx.GraphDef:
    """The graphdef of one `layers.Block`: with one layer's slice of `params["layers"]` it merges
    into that layer's block (`unstack_layers`)."""
    return nnx.split(nnx.eval_shape(lambda: layers.Block(spec, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))))[0]


def unstack_layers(params: Params) -> list[Params]:
    """`params["layers"]` (every leaf [L, ...]) as L per-layer trees, each leaf its own buffer.

    A copy of the layer weights, made once (one jitted call, shardings kept): a step over these
    reads every layer's weights where they lie, where slicing the stack inside the step copies
    them every time (`CausalLM.run_layers`).
    """
    stacked = params["layers"]
    num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    return jax.jit(lambda tree: [jax.tree.map(lambda x: x[i], tree) for i in range(num_layers)])(stacked)


def merge_unstacked(spec: ModelSpec, params: Params, graphdefs: tuple[nnx.GraphDef, nnx.GraphDef] | None = None,
                    ) -> tuple[CausalLM, list[layers.Block]]:
    """(the module, its blocks) over `params` whose "layers" entry is `unstack_layers`' list.

    The module's own stacked `layers` hold abstract shapes only: run it with
    `run_layers(..., blocks=blocks)`, which never touches them. `graphdefs`: the (module, block)
    graphdefs to merge into; default `abstract_model`'s and `abstract_block`'s (the runner's
    packed weights come with their own, `jpaged.models.packed.graphdefs`).
    """
    dtype = params_dtype(params)
    model_def, block_def = graphdefs or (abstract_model(spec, dtype)[0], abstract_block(spec, dtype))
    stacked = param_shapes(spec, dtype)["layers"]  # placeholders, never computed with
    model = nnx.merge(model_def, {**params, "layers": stacked})
    return model, [nnx.merge(block_def, layer) for layer in params["layers"]]


def param_shapes(spec: ModelSpec, dtype: Any = jnp.float32) -> Params:
    """Every parameter as a `jax.ShapeDtypeStruct`, in the pure-dict layout of `init_params`."""
    return nnx.to_pure_dict(abstract_model(spec, dtype)[1])


def params_dtype(params: Params) -> jnp.dtype:
    """The dtype of a parameter tree (one dtype throughout, as `init_params` and the loaders make)."""
    return jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype)


def merge(spec: ModelSpec, params: Params) -> CausalLM:
    """The module over `params` (`nnx.merge`); inside a trace this is how jitted code calls it."""
    return nnx.merge(abstract_model(spec, params_dtype(params))[0], params)


def init_params(spec: ModelSpec, seed: int = 0, dtype: Any = jnp.float32, *, shardings: Any = None) -> Params:
    """Random, seeded parameters (vLLM's "dummy" load format, and the start of training).

    Built by one jitted function, so with `shardings` (a tree of `NamedSharding`s, see
    `jpaged.models.parallel.param_shardings`) every device computes only its own shard: no array is
    ever whole on one device. Values do not depend on the sharding (JAX's partitionable threefry).
    """
    if shardings is None:
        return _initializer(spec, seed, jnp.dtype(dtype))()
    return jax.jit(functools.partial(_init, spec, seed, jnp.dtype(dtype)), out_shardings=shardings)()


def _init(spec: ModelSpec, seed: int, dtype: jnp.dtype) -> Params:
    return nnx.to_pure_dict(nnx.state(CausalLM(spec, dtype=dtype, rngs=nnx.Rngs(seed))))


@functools.lru_cache(maxsize=16)
def _initializer(spec: ModelSpec, seed: int, dtype: jnp.dtype) -> Callable[[], Params]:
    """The jitted `_init` of one (spec, seed, dtype), kept: a process that builds many engines of
    one model (a test session, a sweep) traces and compiles it once (0.2-2 s each time otherwise)."""
    return jax.jit(functools.partial(_init, spec, seed, dtype))


def dense_forward(spec: ModelSpec, params: Params, tokens: jax.Array) -> jax.Array:
    """Full-sequence forward without any cache: tokens i32[B, L] -> float32 logits [B, L, V].

    The reference for the paged step, the training forward, and the engine's dense-cache check.
    """
    return merge(spec, params)(jnp.asarray(tokens))


def param_count(params: Params) -> int:
    """Number of scalars in a parameter tree (compare with `ModelSpec.num_params`)."""
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
