"""Tensor parallelism (Megatron-style, as in the paper's OPT-66B/175B setups) on JAX's SPMD machinery.

A 1-D device mesh with axis `tp`. Parameters carry `NamedSharding`s: attention is split by head
(q/k/v projection columns, output-projection rows), the MLP by hidden unit (up/gate/fc1 columns,
down/fc2 rows), token embedding and LM head by vocabulary when it divides; norms, positions and the
biases added after a row-split projection are replicated. The KV pools `[L, Hkv, N, Bs, D]` are
split on the KV-head axis. One block manager and scheduler run on the host: every device uses the
same block ids and stores only its heads' pages.

The paged attention step (`write_kv` + decode/prefill kernel) runs per shard through `shard_map`,
so the Pallas kernels see the local heads only; everything else is plain jitted code whose
collectives (an all-reduce after each row-split projection, two per layer) XLA's SPMD partitioner
inserts. No hand-written communication.

GQA with fewer KV heads than devices: each KV head is replicated `tp // num_kv_heads` times
(`replicate_kv_heads`), so device d holds the one KV head its query heads read.

Multi-host: `initialize_distributed` joins the processes (one per host) before any other JAX work;
`jax.devices()` then lists every host's devices and the same mesh and program span them. Every
process runs the same engine on the same requests (the scheduler is deterministic), JAX's
multi-controller model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jpaged.models import decoder
from jpaged.models.presets import ModelSpec

TP_AXIS = "tp"

# Projections whose output features are split (heads, MLP hidden units): no communication after.
_COLUMN_SPLIT = frozenset({"q", "k", "v", "fc1", "gate", "up"})
# Projections whose input features are split: each device holds a partial sum, all-reduced.
_ROW_SPLIT = frozenset({"o", "fc2", "down"})


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join a multi-host run: call once per process, before any other JAX work.

    `coordinator_address` is "host:port" of process 0; `process_id` is in [0, num_processes).
    Afterwards `jax.devices()` lists the devices of every host, and `make_mesh` spans them. A
    process that has already joined keeps its membership (a second call does nothing).
    """
    if jax.distributed.is_initialized():
        return
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over the first `tp` devices (default: all of `jax.devices()`, every host's)."""
    devices = jax.devices() if devices is None else devices
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tensor_parallel_size: {tp} needs {tp} devices, found {len(devices)} "
                         f"({devices[0].platform if devices else 'none'})")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def replicate_kv_heads(spec: ModelSpec, params: decoder.Params, tp: int) -> tuple[ModelSpec, decoder.Params]:
    """Repeat each KV head `tp // num_kv_heads` times when there are fewer KV heads than devices.

    Returns the spec with `num_kv_heads = tp` and the k/v projections widened to match: KV head e
    of the result is head `e // r` of the original, which is exactly the head the query heads
    `e * Hq / tp ...` (device e's) read, so attention is unchanged. Otherwise returns the inputs.
    """
    spec.check_tensor_parallel(tp)
    if tp <= spec.num_kv_heads:
        return spec, params
    repeats, heads, head_dim = tp // spec.num_kv_heads, spec.num_kv_heads, spec.head_dim

    def widen(x: jax.Array) -> jax.Array:  # [..., Hkv * D] -> [..., tp * D]
        per_head = x.reshape(*x.shape[:-1], heads, head_dim)
        return jnp.repeat(per_head, repeats, axis=-2).reshape(*x.shape[:-1], tp * head_dim)

    layers = dict(params["layers"])
    for name in ("k", "v"):
        layers[name] = {key: widen(value) for key, value in layers[name].items()}
    return dataclasses.replace(spec, num_kv_heads=tp), {**params, "layers": layers}


def param_partition_specs(spec: ModelSpec, tp: int) -> decoder.Params:
    """The `PartitionSpec` of every parameter (same tree as `decoder.param_shapes`), Megatron-style."""
    vocab = TP_AXIS if spec.vocab_size % tp == 0 else None  # odd vocabularies stay replicated

    def leaf(path, shape: tuple[int, ...]) -> P:
        group, kind = path[0].key, path[-1].key
        if group == "layers" and path[1].key in _COLUMN_SPLIT:
            return P(None, None, TP_AXIS) if kind == "kernel" else P(None, TP_AXIS)  # [L, H, out] / [L, out]
        if group == "layers" and path[1].key in _ROW_SPLIT and kind == "kernel":
            return P(None, TP_AXIS, None)  # [L, in, H]; the bias is added once, after the all-reduce
        if group == "embed":
            return P(vocab, None)  # [V, H]
        if group == "lm_head":
            return P(None, vocab)  # [H, V]
        return P()  # norms, OPT positions, row-split biases

    return jax.tree_util.tree_map_with_path(leaf, decoder.param_shapes(spec),
                                            is_leaf=lambda x: isinstance(x, tuple))


def shard_params(spec: ModelSpec, params: decoder.Params, mesh: Mesh) -> decoder.Params:
    """Place `params` on `mesh` with `param_partition_specs` (each device receives only its shard)."""
    specs = param_partition_specs(spec, mesh.shape[TP_AXIS])
    return jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """KV pools `[L, Hkv, N, Bs, D]` and host-bound blocks `[L, Hkv, P, Bs, D]`: split by KV head."""
    return NamedSharding(mesh, P(None, TP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (logits handed to the sampler, step inputs)."""
    return NamedSharding(mesh, P())


def per_head_shards(mesh: Mesh, fn: Callable[..., Any], num_replicated: int) -> Callable[..., Any]:
    """`fn(q, k_new, v_new, k_pool, v_pool, *replicated) -> (out, k_pool, v_pool)` run per shard.

    q `[T, Hq, D]`, k_new/v_new `[T, Hkv, D]` and the pools `[L, Hkv, N, Bs, D]` are split on their
    head axis; the `num_replicated` trailing arguments (step arrays, layer index) are whole on every
    device. Inside, `fn` sees the local heads only, which is what lets the Pallas kernels run
    unchanged on each shard.
    """
    heads = P(None, TP_AXIS)
    in_specs = (heads,) * 5 + (P(),) * num_replicated
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(heads, heads, heads))


def _shard_map(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """`shard_map` without its replication type checks: the kernels are written for plain arrays
    (a scan carry initialised from constants would otherwise need `pcast` inside every kernel).
    jax >= 0.7 spells it `jax.shard_map(check_vma=...)`, older releases the experimental module."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, check_vma=False, **kwargs)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, check_rep=False, **kwargs)
