"""The attention backends, named in this one place.

- `xla`: the plain-jnp paths (chunk-streamed decode, tiled prefill); any platform.
- `cpu_native`: decode and prefill attention by a C++ XLA FFI kernel that reads the pool in place
  (`native_cpu`, compiled on first use); CPU only. CPU's default when it builds (a C++ compiler
  is found), else `xla`.
- `pallas_triton`: the Pallas kernels lowered through Pallas's Triton backend (A100, H100/H200);
  `interpret=True` runs them on CPU. The GPU default.
- `pallas_mosaic_gpu`: the ragged (prefill and decode) attention through Pallas's Mosaic GPU
  lowering (Hopper; `paged_attention_mgpu`) where it takes the shape (bf16/f16, head_dim 64 or
  128), else the Triton kernel; GPU's interpreter on CPU. Lowered in CI, not yet run on a GPU.
- `pallas`: an alias for the Pallas lowering the project defaults to, today `pallas_triton`.
- `auto`: `pallas` on a GPU, `cpu_native` on CPU (`xla` where it does not build).

JAX deprecates the Pallas Triton lowering in favour of Mosaic GPU. A backend entry names its Pallas
lowering, and every kernel module maps backend names to its implementations (`pick`): the model's
ragged attention has both; the `pallas` alias moves to `pallas_mosaic_gpu` once a GPU run proves it
(experiments/gpu_check.sh runs its tests compiled). The model config, the runner and the tests take
names from here.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax

from pallas_kernels import native_cpu
from pallas_kernels.backend_names import BACKEND_NAMES


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One way to run the attention kernels."""

    name: str
    pallas_lowering: str | None  # None: plain XLA; "triton" or "mosaic_gpu"
    platforms: tuple[str, ...]  # jax backends it compiles for, without interpret mode
    description: str

    def compiler_params(self, *, num_warps: int, num_stages: int):
        """The `pallas_call` compiler params of this backend's lowering."""
        if self.pallas_lowering == "triton":
            return _triton_compiler_params(num_warps=num_warps, num_stages=num_stages)
        raise ValueError(f"backend {self.name!r} has no Pallas lowering")


BACKENDS: dict[str, AttentionBackend] = {
    "xla": AttentionBackend("xla", None, ("cpu", "gpu", "tpu"), "plain jnp: chunk-streamed decode, tiled prefill"),
    "cpu_native": AttentionBackend("cpu_native", None, ("cpu",),
                                   "C++ FFI attention reading the pool in place (native_cpu)"),
    "pallas_triton": AttentionBackend("pallas_triton", "triton", ("gpu",),
                                      "Pallas kernels through the Triton lowering (A100, H100/H200)"),
    "pallas_mosaic_gpu": AttentionBackend("pallas_mosaic_gpu", "mosaic_gpu", ("gpu",),
                                          "ragged attention through the Mosaic GPU lowering (H100/H200), else Triton"),
}
ALIASES = {"pallas": "pallas_triton"}  # the Pallas lowering the project defaults to
PALLAS_TRITON = BACKENDS["pallas_triton"]


def resolve_backend(backend: str) -> str:
    """The canonical backend name: aliases resolved, `auto` -> `pallas` on GPU, `cpu_native` on CPU
    when its kernel builds, else `xla`.

    On CPU the Pallas kernels only run in interpret mode, which is far slower than XLA.
    `cpu_native` that cannot build or run here is a ValueError saying why.
    """
    if backend == "auto":
        if jax.default_backend() == "gpu":
            backend = "pallas"
        else:
            backend = "cpu_native" if native_cpu.available() else "xla"
    backend = ALIASES.get(backend, backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend: must be one of {list(BACKEND_NAMES)}, got {backend!r}")
    if backend == "cpu_native" and not native_cpu.available():
        raise ValueError(f"backend: cpu_native is unavailable here ({native_cpu.unavailable_reason()}); use 'xla'")
    return backend


def pick(impls: Mapping[str, Callable], backend: str, kernel: str) -> Callable:
    """`impls[resolve_backend(backend)]`, or a ValueError naming the kernel and what it has."""
    name = resolve_backend(backend)
    if name not in impls:
        raise ValueError(f"backend: {kernel} has no {name!r} implementation (it has {sorted(impls)})")
    return impls[name]


def bind_impl(impls: Mapping[str, Callable], backend: str, kernel: str, *, interpret: bool, **knobs) -> Callable:
    """`pick`'s implementation, with `interpret` and the tuning knobs bound for a Pallas backend
    (the XLA paths take neither)."""
    impl = pick(impls, backend, kernel)
    if BACKENDS[resolve_backend(backend)].pallas_lowering is None:
        return impl
    return functools.partial(impl, interpret=interpret, **knobs)


def _triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Triton compiler params, passed on every call: jax >= 0.10 lowers a `pallas_call` without
    compiler params to Mosaic GPU."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
