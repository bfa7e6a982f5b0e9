"""Pieces shared by the kernels: Triton compiler params, Triton shape rules, backend selection.

The GPU kernels target the Pallas Triton lowering (A100, H100/H200). jax >= 0.10 lowers a
`pallas_call` without compiler params to Mosaic GPU, so every call passes Triton's params
explicitly. Triton needs power-of-two tensor sizes and at least 16 rows/columns per dot operand;
`check_tile` enforces that in the wrappers, so a kernel that passes in interpret mode also lowers.
"""

from __future__ import annotations

from typing import Literal

import jax
import numpy as np

# Finite stand-in for -inf in masked scores: exp(MASK_VALUE - m) underflows to exactly 0 without
# creating inf - inf = NaN when a whole row is masked.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Triton's dot (mma) needs at least this many rows, columns and contraction elements.
MIN_DOT_DIM = 16

Backend = Literal["auto", "pallas", "xla"]


def triton_compiler_params(*, num_warps: int, num_stages: int):
    """Triton compiler params under the name of the installed jax.

    jax 0.10/0.11 spell it `jax.experimental.pallas.triton.CompilerParams`; older releases
    `jax.experimental.pallas.gpu.TritonCompilerParams`.
    """
    try:
        from jax.experimental.pallas import triton as pltriton

        params_cls = pltriton.CompilerParams
    except (ImportError, AttributeError):
        from jax.experimental.pallas import gpu as plgpu

        params_cls = plgpu.TritonCompilerParams
    return params_cls(num_warps=num_warps, num_stages=num_stages)


def is_power_of_2(n: int) -> bool:
    """True for 1, 2, 4, ...; False for 0 and the rest."""
    return n > 0 and n & (n - 1) == 0


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def check_tile(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise ValueError unless `value` is a power of two >= `minimum` (a Triton tile rule)."""
    if not is_power_of_2(value) or value < minimum:
        raise ValueError(f"{name}: must be a power of two >= {minimum} for the Triton lowering, got {value}")


def check_knob(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise ValueError unless the integer tuning knob `value` is >= `minimum`."""
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def resolve_backend(backend: Backend) -> Literal["pallas", "xla"]:
    """`auto` picks the Pallas kernels on GPU and the XLA (plain jnp) path elsewhere.

    On CPU the Pallas kernels only run in interpret mode, which is far slower than XLA.
    """
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    if backend not in ("pallas", "xla"):
        raise ValueError(f"backend: must be 'auto', 'pallas' or 'xla', got {backend!r}")
    return backend
