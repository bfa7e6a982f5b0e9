"""Model weights: dummy (random, seeded), orbax save/restore, and local Hugging Face safetensors import.

- `save_params` / `restore_params`: an orbax checkpoint holding the parameter pytree and, as JSON
  metadata, the ModelSpec and dtype, so a checkpoint alone rebuilds its model.
- `import_hf`: a local Hugging Face directory (config.json + *.safetensors, as `save_pretrained`
  writes) for OPT or LLaMA. No network and no pickle: safetensors' numpy API reads the tensors.
- `load_params(model_config)`: what the engine calls; dummy weights when no checkpoint is given.
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
from safetensors import safe_open

from jpaged.config import ModelConfig
from jpaged.models.decoder import Params, init_params, param_shapes
from jpaged.models.hf_names import hf_tensor_names, spec_from_hf_config
from jpaged.models.presets import ModelSpec, get_preset

log = logging.getLogger(__name__)


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_params(path: str | Path, spec: ModelSpec, params: Params, *, metadata: dict | None = None) -> None:
    """Writes `params` and {"spec", "dtype", **metadata} to an orbax checkpoint at `path` (replaced)."""
    dtypes = {str(x.dtype) for x in jax.tree_util.tree_leaves(params)}
    if len(dtypes) != 1:
        raise ValueError(f"params: expected one dtype, got {sorted(dtypes)}")
    meta = {"spec": dataclasses.asdict(spec), "dtype": dtypes.pop(), **(metadata or {})}
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), metadata=ocp.args.JsonSave(meta))
    _checkpointer().save(Path(path).absolute(), args, force=True)


def read_metadata(path: str | Path) -> dict:
    """The JSON metadata of a checkpoint written by `save_params` (spec, dtype, and extras)."""
    restored = _checkpointer().restore(Path(path).absolute(), ocp.args.Composite(metadata=ocp.args.JsonRestore()))
    return restored.metadata


def restore_params(path: str | Path) -> tuple[ModelSpec, Params, dict]:
    """Restores (spec, params, metadata) from `save_params` output, onto the default device, bit-exact."""
    meta = read_metadata(path)
    spec = ModelSpec(**meta["spec"])
    # An explicit target places arrays on this machine's default device, whatever device saved them.
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(meta["dtype"]),
                                                                       sharding=sharding),
                                    param_shapes(spec), is_leaf=lambda x: isinstance(x, tuple))
    restored = _checkpointer().restore(Path(path).absolute(),
                                       ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    return spec, restored.params, meta


def _read_safetensors(directory: Path) -> dict[str, Any]:
    """Name -> lazy reader over every *.safetensors file in `directory`, with "model." stripped."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files (pickled .bin weights are not read)")
    tensors: dict[str, Any] = {}
    for file in files:
        handle = safe_open(str(file), framework="np")
        for name in handle.keys():
            tensors[name.removeprefix("model.")] = (handle, name)
    return tensors


def import_hf(directory: str | Path, *, name: str | None = None, dtype: Any = jnp.float32) -> tuple[ModelSpec, Params]:
    """Imports an OPT or LLaMA Hugging Face directory (config.json + safetensors) as (spec, params).

    Raises ValueError naming the tensor when one is missing or has the wrong shape.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory}: no config.json")
    spec = spec_from_hf_config(json.loads(config_path.read_text()), name or directory.name, str(config_path))
    tensors = _read_safetensors(directory)
    shapes = param_shapes(spec)
    leaves = {}
    for path, (names, transposed) in hf_tensor_names(spec).items():
        want = _get(shapes, path)
        per_tensor = want[1:] if path[0] == "layers" else want  # stacked leaves add a [num_layers] axis
        hf_shape = per_tensor[::-1] if transposed else per_tensor
        arrays = []
        for hf_name in names:
            if hf_name not in tensors:
                raise ValueError(f"{directory}: tensor {hf_name} is missing (expected shape {list(hf_shape)})")
            handle, key = tensors[hf_name]
            arr = handle.get_tensor(key)
            if tuple(arr.shape) != tuple(hf_shape):
                raise ValueError(f"{directory}: tensor {hf_name} has shape {list(arr.shape)}, "
                                 f"expected {list(hf_shape)}")
            arrays.append(arr.T if transposed else arr)
        value = np.stack(arrays) if path[0] == "layers" else arrays[0]
        leaves[path] = jnp.asarray(value, dtype=dtype)
    return spec, _unflatten(leaves)


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _unflatten(leaves: dict[tuple[str, ...], Any]) -> Params:
    tree: Params = {}
    for path, value in leaves.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def load_params(config: ModelConfig) -> tuple[ModelSpec, Params]:
    """The engine's entry: (spec, params) in `config.dtype` for `config`.

    No checkpoint: dummy weights of preset `config.name` seeded by `config.seed` (vLLM's dummy
    load format). A directory with config.json: Hugging Face import. Otherwise: an orbax checkpoint
    from `save_params`, whose spec must carry `config.name`.
    """
    dtype = jnp.dtype(config.dtype)
    if config.checkpoint is None:
        spec = get_preset(config.name)
        log.info("dummy weights for %s (seed %d, %s)", spec.name, config.seed, config.dtype)
        return spec, init_params(spec, config.seed, dtype)
    path = Path(config.checkpoint)
    if (path / "config.json").is_file():
        return import_hf(path, name=config.name, dtype=dtype)
    spec, params, _ = restore_params(path)
    if spec.name != config.name:
        raise ValueError(f"model.name: {config.name!r} does not match the checkpoint's model {spec.name!r} "
                         f"at {path}")
    return spec, jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
