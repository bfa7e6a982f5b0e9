"""Dense weights packed once for the native CPU matrix multiply (pallas_kernels.native_dense_cpu).

`ModelRunner` calls `pack_dense` on its per-layer copy of the weights when the CPU native backend
is active (`native_dense_reason` says when it is not): every `layers.Linear` kernel [K, N] in the
tree is replaced by its 16-column panels, so that layer calls the native kernel
(`layers.Linear.__call__` sees a packed kernel), and a tied LM head gets a packed copy of the
embedding's transpose under `HEAD` (the embedding itself stays: the token lookup reads it). The
tree's names are unchanged; only the runner ever holds it (checkpoints keep the plain layout).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jpaged.config.presets import ModelSpec
from pallas_kernels import native_dense_cpu

Params = dict[str, Any]
HEAD = "packed_head"  # the runner's params key of the tied head's panels: pack(embedding.T)
DTYPES = ("float32", "bfloat16")  # what `native_dense_cpu.pack` takes


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


def split_head(params: Params) -> tuple[Params, jax.Array | None]:
    """(the module's own tree, the tied head's panels or None): what `nnx.merge` takes, and the rest."""
    if HEAD not in params:
        return params, None
    rest = dict(params)
    return rest, rest.pop(HEAD)
