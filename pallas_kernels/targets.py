"""The GPUs the kernels are built for: per-target limits, and which target a trace is for.

A wrapper decides its launch shape (splits, warps) and checks its knobs at trace time, so it must
know the GPU it is being traced for: the local GPU when there is one; else the abstract GPU device
of an enclosing `jax.sharding.use_abstract_mesh` (how a CPU-only machine lowers for a GPU, see
`abstract_gpu`); else A100 (sm_80), whose limits are the tighter of the two targets the project
supports, so a launch that passes on a CPU trace also fits an H100.

Numbers are NVIDIA's (CUDA C Programming Guide, "Compute Capabilities"): shared memory per block
is the opt-in maximum (XLA and Triton opt in), per SM what the L1/shared carve-out allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One CUDA compute capability's limits, with the SM count of its reference device."""

    name: str  # "sm_80"
    capability: int  # 80
    device_kind: str  # reference device, as jax spells its device_kind
    num_sms: int  # SMs of the reference device (the local device's own count wins when known)
    smem_per_block: int  # bytes of shared memory one program (CTA) may use
    smem_per_sm: int  # bytes of shared memory per SM (bounds how many programs are resident)
    max_warps_per_sm: int
    max_programs_per_sm: int = 32
    regs_per_sm: int = 65536
    max_regs_per_thread: int = 255
    max_warps_per_program: int = 32  # 1024 threads


A100 = GpuTarget("sm_80", 80, "NVIDIA A100-SXM4-80GB", num_sms=108, smem_per_block=166_912, smem_per_sm=167_936,
                 max_warps_per_sm=64)
H100 = GpuTarget("sm_90", 90, "NVIDIA H100 80GB HBM3", num_sms=132, smem_per_block=232_448, smem_per_sm=233_472,
                 max_warps_per_sm=64)
# Consumer / inference Ampere and Ada parts (A10, L4, L40, RTX 30/40): 99 KB per block.
SM86 = GpuTarget("sm_86", 86, "NVIDIA A10", num_sms=72, smem_per_block=101_376, smem_per_sm=102_400,
                 max_warps_per_sm=48)
SM89 = GpuTarget("sm_89", 89, "NVIDIA L4", num_sms=58, smem_per_block=101_376, smem_per_sm=102_400,
                 max_warps_per_sm=48, max_programs_per_sm=24)
TARGETS = {t.capability: t for t in (A100, SM86, SM89, H100)}
SUPPORTED = (A100, H100)  # what the compile tests prove; others get their table limits unproven
DEFAULT = A100


def target_for_capability(capability: int, num_sms: int | None = None) -> GpuTarget:
    """The target of a compute capability (e.g. 80, 90), with the device's SM count if known.

    Capabilities not in the table get the nearest lower entry's limits (never looser than a
    device of that generation allows); below sm_80 the kernels are not supported (Triton's bf16
    dot and the async copies they rely on need Ampere).
    """
    if capability < 80:
        raise ValueError(f"GPU compute capability {capability / 10:.1f}: the Pallas kernels need sm_80 or newer")
    known = max(c for c in TARGETS if c <= capability)
    base = TARGETS[known]
    if known != capability:
        base = dataclasses.replace(base, name=f"sm_{capability}", capability=capability)
    return base if num_sms is None else dataclasses.replace(base, num_sms=num_sms)


def _target_for_device_kind(device_kind: str, num_sms: int | None) -> GpuTarget:
    kinds = (("H100", 90), ("H200", 90), ("H800", 90), ("A100", 80), ("A800", 80), ("A10", 86),
             ("L40", 89), ("L4", 89))
    for marker, capability in kinds:
        if re.search(rf"\b{marker}\b", device_kind):
            return target_for_capability(capability, num_sms)
    raise ValueError(f"abstract GPU device_kind {device_kind!r}: unknown; use one of "
                     f"{[t.device_kind for t in TARGETS.values()]}")


def current_target() -> GpuTarget:
    """The GPU this trace is for: local GPU, else the abstract mesh's GPU device, else A100."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.platform in ("gpu", "cuda"):
        return _target_for_device_kind(abstract.device_kind, abstract.num_cores)
    if jax.default_backend() == "gpu":
        device = jax.devices()[0]
        capability = getattr(device, "compute_capability", None)
        if capability is not None:
            return target_for_capability(int(str(capability).replace(".", "")), getattr(device, "core_count", None))
    return DEFAULT


@contextlib.contextmanager
def abstract_gpu(target: GpuTarget):
    """Trace and lower for `target` on a machine without that GPU.

    Newer jax (>= 0.11) refuses to lower a Triton `pallas_call` without a GPU unless an abstract
    GPU device says which one (its compute capability picks Triton's target); jax 0.10 ignores
    it and lowers for sm_90. `current_target()` reads the same device, so the wrappers choose the
    launch shape and check the limits of `target`. Use with `.lower(lowering_platforms=("cuda",))`.
    """
    device = jax.sharding.AbstractDevice(device_kind=target.device_kind, num_cores=target.num_sms, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
