"""Dense weights packed once for the native CPU matrix multiply (pallas_kernels.native_dense_cpu).

The model's modules are plain Flax: their dense layers are `nnx.Linear`s. When the CPU native
backend is active (`native_dense_reason` says when it is not), `ModelRunner` packs its per-layer
copy of the weights with `pack_dense`: every dense kernel [K, N] in the tree is replaced by its
16-column panels, and a tied LM head gets a packed copy of the embedding's transpose under `HEAD`
(the embedding itself stays: the token lookup reads it). The tree's names are unchanged, and the
runner merges it into `graphdefs`, the model's and a block's graphdefs with every `nnx.Linear`
replaced by a `PackedLinear` (same state names, the same semantics by the native kernel), and
gives the tied head to `CausalLM.logits` as a `PackedLinear` (`split_head`). Only the runner ever
holds packed weights (checkpoints keep the plain layout).

`rows_in_use(n)`: while a step is traced inside it, every PackedLinear computes only the first n
rows (a traced i32[]: the step's real tokens, or its logits rows in use for the LM head) and leaves
zeros in the padding rows of the token bucket, as the ragged attention already skips them. A
context rather than an argument: the Flax modules' call signatures stay those of `nnx.Linear`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jpaged.config.presets import ModelSpec
from jpaged.models import decoder, layers
from pallas_kernels import native_dense_cpu

Params = dict[str, Any]
HEAD = "packed_head"  # the runner's params key of the tied head's panels: pack(embedding.T)
DTYPES = ("float32", "bfloat16")  # what `native_dense_cpu.pack` takes
# i32[] rows of a PackedLinear's input that are real (None: all), set by `rows_in_use` while tracing
_ROWS_IN_USE: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("rows_in_use", default=None)


@contextlib.contextmanager
def rows_in_use(count: jax.Array) -> Iterator[None]:
    """PackedLinears traced inside compute only the first `count` rows of their inputs (flattened
    to [M, K]); the rest of their outputs are zeros."""
    token = _ROWS_IN_USE.set(count)
    try:
        yield
    finally:
        _ROWS_IN_USE.reset(token)


class PackedLinear(nnx.Module):
    """A dense layer over `native_dense_cpu.pack`'s panels: an `nnx.Linear` of the model
    (`layers.linear`: x rounded to the weights' dtype, float32 accumulation and output) computed by
    the native CPU kernel. Its state has the Linear's names: `kernel` (the panels), `bias`."""

    def __init__(self, kernel: jax.Array, bias: jax.Array | None, out_features: int):
        self.kernel = nnx.Param(kernel)  # float32 [P, K, 16] or uint16 [P, Kp/2, 16, 2] (`pack`)
        self.bias = nnx.Param(bias) if bias is not None else None  # [N]
        self.out_features = out_features  # N

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """inputs [..., K] -> float32 [..., N]."""
        bias = self.bias[...] if self.bias is not None else None
        return native_dense_cpu.matmul(inputs, self.kernel[...], bias, out_features=self.out_features,
                                       rows_in_use=_ROWS_IN_USE.get())


def native_dense_reason(params: Params) -> str | None:
    """None when `pack_dense` applies to these weights on this machine, else why not."""
    dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype)
    if dtype.name not in DTYPES:
        return f"the native dense kernel takes {' or '.join(DTYPES)} weights, not {dtype.name}"
    return native_dense_cpu.unavailable_reason()


def _pack_kernels(tree: Any) -> Any:
    """Every {"kernel": [K, N], ...} dict of a Linear in `tree` (dicts and lists) with its kernel packed."""
    if isinstance(tree, list):
        return [_pack_kernels(item) for item in tree]
    if not isinstance(tree, dict):
        return tree
    out = {name: _pack_kernels(value) for name, value in tree.items()}
    if "kernel" in out and not native_dense_cpu.is_packed(out["kernel"]):
        out["kernel"] = native_dense_cpu.pack(out["kernel"])
    return out


def pack_dense(spec: ModelSpec, params: Params) -> Params:
    """Per-layer `params` (`layers` a list of trees, `decoder.unstack_layers`) with every dense
    kernel packed, and HEAD for a tied head. Stacked kernels [L, K, N] are not what this packs."""
    out = _pack_kernels(params)
    if spec.tie_word_embeddings:
        out[HEAD] = native_dense_cpu.pack(params["embed"]["embedding"].T)  # [V, H] -> panels of [H, V]
    return out


def _with_packed_linears(module: nnx.Module) -> nnx.Module:
    """`module` with each of its own `nnx.Linear` attributes replaced by a PackedLinear (not nested
    ones: a model's stacked layers stay, the per-layer blocks are merged separately)."""
    for name, child in list(vars(module).items()):
        if isinstance(child, nnx.Linear):
            bias = child.bias[...] if child.bias is not None else None
            setattr(module, name, PackedLinear(native_dense_cpu.pack(child.kernel[...]), bias, child.out_features))
    return module


@functools.lru_cache(maxsize=64)
def graphdefs(spec: ModelSpec, dtype: Any) -> tuple[nnx.GraphDef, nnx.GraphDef]:
    """(model, block) graphdefs for `decoder.merge_unstacked` over `pack_dense`'s tree: those of
    `decoder.CausalLM` and `layers.Block` in `dtype`, their dense layers PackedLinears."""
    dtype = jnp.dtype(dtype)
    model = nnx.eval_shape(lambda: _with_packed_linears(decoder.CausalLM(spec, dtype=dtype, rngs=nnx.Rngs(0))))
    block = nnx.eval_shape(lambda: _with_packed_linears(layers.Block(spec, dtype=dtype, rngs=nnx.Rngs(0))))
    return nnx.graphdef(model), nnx.graphdef(block)


def split_head(spec: ModelSpec, params: Params) -> tuple[Params, PackedLinear | None]:
    """(the module's own tree, the tied head over its panels or None): what `nnx.merge` takes, and
    the `head` for `CausalLM.logits`."""
    if HEAD not in params:
        return params, None
    rest = dict(params)
    return rest, PackedLinear(rest.pop(HEAD), None, spec.vocab_size)
