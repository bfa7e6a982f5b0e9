"""Model weights: dummy (random, seeded), orbax save/restore of the Flax state, local Hugging Face import.

- `save_params` / `restore_params`: an orbax checkpoint of the model's pure-dict Flax state and, as
  JSON metadata, the ModelSpec and dtype, so a checkpoint alone rebuilds its model. Stacked tensors
  are stored in chunks of at most one layer (`CHUNK_BYTES`), so reading a shard touches one layer
  of a tensor at a time.
- `import_hf`: a local Hugging Face directory (config.json + *.safetensors, as `save_pretrained`
  writes) for OPT or LLaMA. No network and no pickle: safetensors' numpy API reads the tensors.
- With a `mesh`, both place every tensor straight into its `NamedSharding`: orbax (tensorstore)
  and the safetensors slices read only each device's shard, so no model is ever whole on one
  device or in host memory. KV heads fewer than devices are replicated on the way
  (`parallel.checkpoint_shardings` / `widen_kv_shards`); the returned spec is the serving one.
- `load_params(model_config, mesh)`: what the engine calls; dummy weights when no checkpoint is given.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open

from jpaged.config import ModelConfig
from jpaged.config.presets import ModelSpec, get_preset
from jpaged.models import decoder, parallel
from jpaged.models.hf_names import hf_tensor_names, spec_from_hf_config

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024**2  # largest stored chunk; stacked tensors are also split per layer
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")  # what a checkpoint's weights may be stored as
# safetensors dtypes a Hugging Face weight may have (integer or bool tensors would load silently wrong)
_HF_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def resolve_dtype(name: str) -> jnp.dtype:
    """`model.dtype` as a jnp dtype; "auto" is bfloat16 on accelerators and float32 on CPU."""
    if name == "auto":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    return jnp.dtype(name)


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _placements(spec: ModelSpec, mesh: Mesh | None) -> decoder.Params:
    """Where each tensor of a `spec` checkpoint goes: its shards on `mesh`, or the default device."""
    if mesh is not None:
        return parallel.checkpoint_shardings(spec, mesh)
    device = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, decoder.param_shapes(spec))


def save_params(path: str | Path, spec: ModelSpec, params: decoder.Params | nnx.State, *,
                metadata: dict | None = None) -> None:
    """Writes `params` and {"spec", "dtype", **metadata} to an orbax checkpoint at `path` (replaced)."""
    params = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params: expected one dtype, got {sorted(dtypes)}")
    meta = {"spec": dataclasses.asdict(spec), "dtype": dtypes.pop(), **(metadata or {})}
    # One layer per chunk (axis 0 of stacked tensors), then at most CHUNK_BYTES.
    save_args = jax.tree_util.tree_map_with_path(
        lambda p, _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES, shard_axes=(0,) if p[0].key == "layers" else ()),
        params)
    args = ocp.args.Composite(params=ocp.args.StandardSave(params, save_args=save_args),
                              metadata=ocp.args.JsonSave(meta))
    _checkpointer().save(Path(path).absolute(), args, force=True)


def read_metadata(path: str | Path) -> dict:
    """The JSON metadata of a checkpoint written by `save_params` (spec, dtype, and extras), checked:
    ValueError naming the key and the checkpoint when it is missing, malformed or out of range."""
    path = Path(path).absolute()
    _check_metadata_file(path / "metadata" / "metadata")
    try:
        meta = _checkpointer().restore(path, ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata
    except Exception as exc:  # orbax raises many kinds (missing dir, no metadata item, bad JSON)
        raise ValueError(f"{path}: not a checkpoint written by save_params ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("spec"), dict):
        raise ValueError(f"{path}: metadata must be an object with a 'spec' object, got {meta!r:.200}")
    if meta.get("dtype") not in WEIGHT_DTYPES:
        raise ValueError(f"{path}: metadata dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {meta.get('dtype')!r}")
    try:
        ModelSpec.from_dict(meta["spec"])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: metadata spec: {exc}") from None
    return meta


def _check_metadata_file(file: Path) -> None:
    """ValueError naming `file` when a checkpoint has its metadata file (where save_params writes it)
    but the file cannot be read as JSON: the checkpoint is damaged, not foreign, and orbax's own
    error would say neither which file nor why."""
    if not file.is_file():
        return  # no such file: orbax's restore says the folder is not a checkpoint
    try:
        json.loads(file.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: the checkpoint's metadata file is unreadable "
                         f"({type(exc).__name__}: {exc})") from None


def restore_params(path: str | Path, *, mesh: Mesh | None = None, dtype: Any = None,
                   ) -> tuple[ModelSpec, decoder.Params, dict]:
    """Restores (spec, params, metadata) from `save_params` output, bit-exact in the saved dtype.

    Without `mesh` onto the default device; with one, each device reads only its shard (the spec
    returned then has the serving number of KV heads). `dtype` converts while reading. Reads are
    throttled to about one shard at a time (`_read_budget`): beyond the restored arrays, host
    memory holds roughly the largest single read, never another copy of the model.
    """
    meta = read_metadata(path)
    spec = ModelSpec.from_dict(meta["spec"])
    dtype = jnp.dtype(dtype or meta["dtype"])
    target = jax.tree.map(lambda shape, where: jax.ShapeDtypeStruct(shape.shape, dtype, sharding=where),
                          decoder.param_shapes(spec), _placements(spec, mesh))
    items = Path(path).absolute() / "params"  # the Composite checkpoint's item directory
    budget = _read_budget(ocp.StandardCheckpointHandler().metadata(items), target)
    reader = ocp.Checkpointer(ocp.StandardCheckpointHandler(restore_concurrent_gb=budget / 1e9))
    params = reader.restore(items, ocp.args.StandardRestore(target))
    if mesh is not None:
        spec, params = parallel.widen_kv_shards(spec, params, mesh)
    return spec, params, meta


def _read_budget(stored: Any, target: decoder.Params) -> int:
    """Bytes orbax may read at once: just above its largest single read, so reads run ~one at a time.

    Orbax reserves, for each distinct shard, the bytes of the stored chunks that cover it (a read
    larger than the budget is an error), so the budget is the maximum of that over all shards.
    """
    largest = 0
    for saved, want in zip(jax.tree_util.tree_leaves(stored), jax.tree_util.tree_leaves(target)):
        chunk = saved.storage.chunk_shape if saved.storage and saved.storage.chunk_shape else want.shape
        for index in want.sharding.addressable_devices_indices_map(want.shape).values():
            covered = np.dtype(saved.dtype).itemsize
            for part, size, step in zip(index, want.shape, chunk):
                lo, hi, _ = part.indices(size)
                covered *= -(-hi // step) * step - lo // step * step
            largest = max(largest, covered)
    return largest + 1


def _index_safetensors(directory: Path) -> dict[str, Any]:
    """Name -> (open file, key, file path) for every tensor of every *.safetensors file, "model."
    stripped. A file that is not valid safetensors (truncated, corrupted header) raises ValueError
    naming it."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (pickled .bin weights are not read)")
    tensors: dict[str, Any] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="np")
            names = list(handle.keys())
        except Exception as exc:  # safetensors' own error type, or OSError
            raise ValueError(f"{file}: not a readable safetensors file ({exc})") from None
        for name in names:
            tensors[name.removeprefix("model.")] = (handle, name, file)
    return tensors


def _shard_reader(sources: list[Any], stacked: bool, transposed: bool, dtype: Any):
    """Callback for `jax.make_array_from_callback`: reads one shard (an index into our layout).

    Only the shard's slice of each Hugging Face tensor is read; torch Linear weights are [out, in]
    where our kernels are [in, out], so the slice is taken transposed, then flipped.
    """

    def read(index: tuple[slice, ...]) -> np.ndarray:
        layers, inner = (sources[index[0]], index[1:]) if stacked else (sources, index)
        parts = []
        for handle, key, file in layers:
            try:
                part = handle.get_slice(key)[tuple(reversed(inner)) if transposed else inner]
            except Exception as exc:
                raise ValueError(f"{file}: tensor {key} could not be read ({exc})") from None
            parts.append(part.T if transposed else part)
        return (np.stack(parts) if stacked else parts[0]).astype(dtype)

    return read


def import_hf(directory: str | Path, *, name: str | None = None, dtype: Any = jnp.float32,
              mesh: Mesh | None = None) -> tuple[ModelSpec, decoder.Params]:
    """Imports an OPT or LLaMA Hugging Face directory (config.json + safetensors) as (spec, params).

    Raises ValueError naming the file, and the key or tensor, when config.json is not valid JSON or
    a field has the wrong type or range, or a tensor is missing, misshaped or not floating point,
    before any tensor is read (and naming the tensor if a read fails). With `mesh`, each device
    reads only its shard (see the module docstring).
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: not valid JSON ({exc})") from None
    spec = spec_from_hf_config(config, name or directory.name, str(config_path))
    tensors = _index_safetensors(directory)
    shapes, placements = decoder.param_shapes(spec), _placements(spec, mesh)
    leaves: dict[tuple[str, ...], jax.Array] = {}
    for path, (names, transposed) in hf_tensor_names(spec).items():
        want = _get(shapes, path).shape
        per_tensor = want[1:] if path[0] == "layers" else want  # stacked leaves add a [num_layers] axis
        hf_shape = per_tensor[::-1] if transposed else per_tensor
        for hf_name in names:
            if hf_name not in tensors:
                raise ValueError(f"{directory}: tensor {hf_name} is missing (expected shape {list(hf_shape)})")
            handle, key, file = tensors[hf_name]
            stored = handle.get_slice(key)
            if tuple(stored.get_shape()) != tuple(hf_shape):
                raise ValueError(f"{file}: tensor {hf_name} has shape {stored.get_shape()}, expected {list(hf_shape)}")
            if stored.get_dtype() not in _HF_FLOAT_DTYPES:
                raise ValueError(f"{file}: tensor {hf_name} has dtype {stored.get_dtype()}; weights must be "
                                 f"floating point ({', '.join(_HF_FLOAT_DTYPES)})")
        reader = _shard_reader([tensors[n] for n in names], path[0] == "layers", transposed, jnp.dtype(dtype))
        leaves[path] = jax.make_array_from_callback(want, _get(placements, path), reader)
    params = _unflatten(leaves)
    if mesh is not None:
        spec, params = parallel.widen_kv_shards(spec, params, mesh)
    return spec, params


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _unflatten(leaves: dict[tuple[str, ...], Any]) -> decoder.Params:
    tree: decoder.Params = {}
    for path, value in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load_params(config: ModelConfig, mesh: Mesh | None = None) -> tuple[ModelSpec, decoder.Params]:
    """The engine's entry: (serving spec, params) in `config.dtype`, placed on `mesh` when given.

    No checkpoint: dummy weights of preset `config.name` seeded by `config.seed` (vLLM's dummy
    load format), born sharded. A directory with config.json: Hugging Face import. Otherwise: an
    orbax checkpoint from `save_params`, whose spec must carry `config.name`.
    """
    dtype = resolve_dtype(config.dtype)
    if config.checkpoint is None:
        spec = get_preset(config.name)
        log.info("dummy weights for %s (seed %d, %s)", spec.name, config.seed, dtype)
        if mesh is not None:
            return parallel.init_params(spec, config.seed, dtype, mesh)
        return spec, decoder.init_params(spec, config.seed, dtype)
    path = Path(config.checkpoint)
    if (path / "config.json").is_file():
        return import_hf(path, name=config.name, dtype=dtype, mesh=mesh)
    saved = read_metadata(path)["spec"]["name"]
    if saved != config.name:
        raise ValueError(f"model.name: {config.name!r} does not match the checkpoint's model {saved!r} at {path}")
    spec, params, _ = restore_params(path, mesh=mesh, dtype=dtype)
    return spec, params
