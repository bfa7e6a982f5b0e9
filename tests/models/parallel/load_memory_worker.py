"""One measurement of tests/models/parallel/test_load_memory.py, in a fresh process with 4 virtual CPU devices.

Usage: python -m tests.models.parallel.load_memory_worker MODE CHECKPOINT, MODE one of
  save           write dummy weights of MEMORY_SPEC to CHECKPOINT (orbax)
  restore        orbax restore straight into the shards of a 4-device mesh (checkpoint.restore_params)
  restore-whole  the naive way, the control: restore onto one device, then shard
  init           compile the sharded dummy initialisation (parallel.sharded_initializer), per device
Prints one JSON line of byte counts.
"""

import json
import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"  # before jax initialises

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jpaged.config.presets import ModelSpec  # noqa: E402
from jpaged.models import (  # noqa: E402
    checkpoint,
    decoder,  # noqa: E402
    parallel,
)

# 219 MB of float32 parameters, 50 MB per layer; every split axis divides by 4.
MEMORY_SPEC = ModelSpec(name="memory-opt", family="opt", vocab_size=4096, hidden_size=1024, num_layers=4,
                        num_heads=16, num_kv_heads=16, head_dim=64, intermediate_size=4096,
                        max_position_embeddings=128)
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    """Resident set size now (Linux /proc)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def peak_resident_bytes() -> int:
    """Peak resident set size since the last `reset_peak` (VmHWM, Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Start VmHWM afresh from the current resident size (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def layer_bytes(spec: ModelSpec) -> int:
    """Bytes of one decoder layer's parameters (float32)."""
    shapes = decoder.param_shapes(spec)["layers"]
    return sum(x.size // spec.num_layers * 4 for x in jax.tree.leaves(shapes))


def measure_restore(path: str, whole: bool) -> dict:
    """Peak resident bytes above the start while restoring `path` onto the mesh."""
    mesh = parallel.make_mesh(4)
    jnp.zeros(4).block_until_ready()  # the CPU client and its thread pools exist before the baseline
    reset_peak()
    before = resident_bytes()
    if whole:
        spec, params, _ = checkpoint.restore_params(path)
        params = parallel.shard_params(spec, params, mesh)
    else:
        _, params, _ = checkpoint.restore_params(path, mesh=mesh)
    jax.block_until_ready(params)
    peak = peak_resident_bytes()
    return {"above_start": peak - before, "restored_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
            "q_shard_shape": list(params["layers"]["q"]["kernel"].addressable_shards[0].data.shape)}


def main(mode: str, path: str) -> dict:
    spec = MEMORY_SPEC
    sizes = {"param_bytes": spec.num_params() * 4, "layer_bytes": layer_bytes(spec)}
    if mode == "save":
        checkpoint.save_params(path, spec, decoder.init_params(spec, 0))
        return sizes
    if mode in ("restore", "restore-whole"):
        return sizes | measure_restore(path, whole=mode == "restore-whole")
    if mode == "init":
        _, initializer = parallel.sharded_initializer(spec, 0, jnp.float32, parallel.make_mesh(4))
        memory = initializer.lower().compile().memory_analysis()  # per device
        return sizes | {"device_output_bytes": memory.output_size_in_bytes, "device_temp_bytes": memory.temp_size_in_bytes}
    raise ValueError(f"mode must be save, restore, restore-whole or init, got {mode!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
