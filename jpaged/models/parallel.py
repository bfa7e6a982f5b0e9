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

Weights never exist whole on one device: dummy weights are drawn by one jitted function with
`out_shardings` (`init_params`), checkpoints are read shard by shard into `checkpoint_shardings`
(jpaged.models.checkpoint), and replicated KV heads are relabelled in place (`widen_kv_shards`).

Multi-host: `initialize_distributed` joins the processes (one per host) before any other JAX work;
`jax.devices()` then lists every host's devices and the same mesh and program span them. Every
process must launch the same steps in the same order (JAX's multi-controller model): `jpaged serve`
schedules on process 0 and ships its plans to the others (jpaged.executors.remote); an offline run
may instead give every process the same requests (the scheduler is deterministic).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jpaged.config.presets import ModelSpec
from jpaged.models import decoder

TP_AXIS = "tp"


def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int) -> None:
    """Join a multi-host run: call once per process, before any other JAX work.

    `coordinator_address` is "host:port" of process 0; `process_id` is in [0, num_processes).
    Afterwards `jax.devices()` lists the devices of every host, and `make_mesh` spans them. A
    process that has already joined keeps its membership (a second call does nothing). Process 0's
    coordinator service (unauthenticated gRPC) binds `coordinator_address` only, not jax's default
    of every interface; $JAX_COORDINATOR_BIND_ADDRESS still chooses another.
    """
    if jax.distributed.is_initialized():
        return
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    bind_address = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", coordinator_address)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, coordinator_bind_address=bind_address)


def make_mesh(tp: int, devices: list[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh over the first `tp` devices (default: all of `jax.devices()`, every host's)."""
    devices = jax.devices() if devices is None else devices
    if not 1 <= tp <= len(devices):
        raise ValueError(f"tensor_parallel_size: {tp} needs {tp} devices, found {len(devices)} "
                         f"({devices[0].platform if devices else 'none'})")
    return Mesh(np.asarray(devices[:tp]), (TP_AXIS,))


def _serving_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """`spec` with `num_kv_heads = tp` when there are fewer KV heads than devices, else `spec`."""
    spec.check_tensor_parallel(tp)
    return dataclasses.replace(spec, num_kv_heads=tp) if tp > spec.num_kv_heads else spec


def replicate_kv_heads(spec: ModelSpec, params: decoder.Params, tp: int) -> tuple[ModelSpec, decoder.Params]:
    """Repeat each KV head `tp // num_kv_heads` times when there are fewer KV heads than devices.

    Returns the spec with `num_kv_heads = tp` and the k/v projections widened to match: KV head e
    of the result is head `e // r` of the original, which is exactly the head the query heads
    `e * Hq / tp ...` (device e's) read, so attention is unchanged. Otherwise returns the inputs.
    Traceable: `init_params` runs it inside the sharded initialisation.
    """
    wide = _serving_spec(spec, tp)
    if wide is spec:
        return spec, params
    repeats, heads, head_dim = tp // spec.num_kv_heads, spec.num_kv_heads, spec.head_dim

    def widen(x: jax.Array) -> jax.Array:  # [..., Hkv * D] -> [..., tp * D]
        per_head = x.reshape(*x.shape[:-1], heads, head_dim)
        return jnp.repeat(per_head, repeats, axis=-2).reshape(*x.shape[:-1], tp * head_dim)

    layers = dict(params["layers"])
    for name in ("k", "v"):
        layers[name] = {key: widen(value) for key, value in layers[name].items()}
    return wide, {**params, "layers": layers}


def param_partition_specs(spec: ModelSpec, tp: int) -> decoder.Params:
    """The `PartitionSpec` of every parameter (pure-dict tree), Megatron-style, from its logical axes.

    The model names each axis (jpaged.models.layers); Flax's logical axis rules map the names onto
    the mesh: heads and MLP units split over `tp`, the vocabulary too when it divides (odd
    vocabularies stay replicated), the residual width ("embed") and the layer axis never. So q/k/v
    and fc1/gate/up split by output column, o/fc2/down by input row (their biases replicated).
    """
    vocab = TP_AXIS if spec.vocab_size % tp == 0 else None
    rules = (("vocab", vocab), ("q_heads", TP_AXIS), ("kv_heads", TP_AXIS), ("mlp", TP_AXIS),
             ("embed", None), ("layers", None))
    with nnx.logical_axis_rules(rules):
        specs = nnx.to_pure_dict(nnx.get_partition_spec(decoder.abstract_model(spec)[1]))
    # A leaf with no split axis is written P(), the spelling of "replicated".
    return jax.tree.map(lambda s: s if any(name is not None for name in s) else P(), specs)


def param_shardings(spec: ModelSpec, mesh: Mesh) -> decoder.Params:
    """`NamedSharding`s of every parameter on `mesh` (`param_partition_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), param_partition_specs(spec, mesh.shape[TP_AXIS]))


def shard_params(spec: ModelSpec, params: decoder.Params, mesh: Mesh) -> decoder.Params:
    """Place in-memory `params` on `mesh` with `param_shardings` (each device receives only its shard)."""
    return jax.device_put(params, param_shardings(spec, mesh))


def init_params(spec: ModelSpec, seed: int, dtype: Any, mesh: Mesh) -> tuple[ModelSpec, decoder.Params]:
    """Dummy weights born sharded: (serving spec, params) with KV heads replicated as needed.

    One jitted function (`sharded_initializer`) draws `decoder.init_params(spec, seed)` and
    widens k/v; its `out_shardings` make every device compute only its own shard, so no preset is
    ever whole on one device, and the values equal the single-device ones.
    """
    wide, initializer = sharded_initializer(spec, seed, dtype, mesh)
    return wide, initializer()


def sharded_initializer(spec: ModelSpec, seed: int, dtype: Any, mesh: Mesh) -> tuple[ModelSpec, Callable]:
    """(serving spec, the jitted zero-argument function `init_params` calls); lower it to inspect memory."""
    tp = mesh.shape[TP_AXIS]
    wide = _serving_spec(spec, tp)

    def init() -> decoder.Params:
        return replicate_kv_heads(spec, decoder.init_params(spec, seed, dtype), tp)[1]

    return wide, jax.jit(init, out_shardings=param_shardings(wide, mesh))


def checkpoint_shardings(spec: ModelSpec, mesh: Mesh) -> decoder.Params:
    """Where to read each tensor of a checkpoint of `spec` (its own KV heads) to serve it on `mesh`.

    `param_shardings`, except for k/v when there are fewer KV heads than devices: those are split
    by KV head over the mesh viewed as [Hkv, tp / Hkv], so the r = tp / Hkv devices that serve head
    e's replicas each read head e. `widen_kv_shards` then relabels the shards in place.
    """
    tp = mesh.shape[TP_AXIS]
    shardings = param_shardings(_serving_spec(spec, tp), mesh)
    if tp <= spec.num_kv_heads:
        return shardings
    groups = Mesh(mesh.devices.reshape(spec.num_kv_heads, tp // spec.num_kv_heads), (TP_AXIS, "kv_replica"))
    layers = dict(shardings["layers"])
    for name in ("k", "v"):
        layers[name] = {key: NamedSharding(groups, s.spec) for key, s in layers[name].items()}
    return {**shardings, "layers": layers}


def widen_kv_shards(spec: ModelSpec, params: decoder.Params, mesh: Mesh) -> tuple[ModelSpec, decoder.Params]:
    """(serving spec, params) from tensors placed by `checkpoint_shardings`: no copy, no communication.

    Device d of the [Hkv, r] view holds original KV head d // r, which is head d of the widened
    projections (`replicate_kv_heads`), i.e. exactly its shard under `param_shardings`.
    """
    tp = mesh.shape[TP_AXIS]
    wide = _serving_spec(spec, tp)
    if wide is spec:
        return spec, params
    targets = param_shardings(wide, mesh)["layers"]

    def relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        shape = (*x.shape[:-1], tp * spec.head_dim)
        by_device = {shard.device: shard.data for shard in x.addressable_shards}
        return jax.make_array_from_single_device_arrays(
            shape, sharding, [by_device[d] for d in sharding.addressable_devices_indices_map(shape)])

    layers = dict(params["layers"])
    for name in ("k", "v"):
        layers[name] = {key: relabel(x, targets[name][key]) for key, x in layers[name].items()}
    return wide, {**params, "layers": layers}


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
