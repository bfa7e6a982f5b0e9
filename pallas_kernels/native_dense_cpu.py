"""Native CPU dense layers: weights packed once into 16-column panels, multiplied by a C++ XLA FFI call.

A decode step multiplies a few (8-64) activation rows by every weight matrix of the model, so it
is bound by reading the weights: a matmul over weights prepacked once reads each as contiguous
streams (docs/notes/cpu-path.md). `pack` lays a kernel W [K, N] out once (at model
load, `jpaged.models.packed`) as contiguous 16-column panels; `matmul` computes x . W (+ bias)
from them with `native/dense_cpu.cc`: float32 accumulation, a register tile of 8 rows x 3
panels, panels spread over XLA's intra-op threads. bfloat16 weights are packed in pairs along K, the operand layout of
AVX-512 BF16's `vdpbf16ps`, used where the CPU has it (the library is built with -march=native and
cached per CPU); elsewhere the pairs are widened to float32 in registers. Oracle: `jnp.dot` in
float32 (tests/pallas_kernels/test_native_dense_cpu.py). Built and loaded like the attention
kernel (`native_cpu.load_ffi`); `JPAGED_NATIVE_CPU=0` turns it off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native_cpu

SOURCE = Path(__file__).with_name("native") / "dense_cpu.cc"
TARGET = "jpaged_dense_cpu"
LANES = 16  # columns per panel
BF16_K_MULTIPLE = 32  # bf16 panels pad K to a multiple of one AMX tile's 32 K values
BF16_PATHS = {"auto": 0, "avx512_bf16": 1, "widen": 2}  # dense_cpu.cc's `bf16_path` attribute
# The micro-kernel's `acc += w * x` must compile to fused multiply-adds (ISO C++ mode contracts none).
FLAGS = native_cpu.FLAGS + ("-ffp-contract=fast",)
PACKED_DTYPES = {jnp.dtype(jnp.float32): jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16)}


def unavailable_reason() -> str | None:
    """None when the kernel is built and registered (and JAX runs on CPU), else why not (builds and
    loads it on first call)."""
    if jax.default_backend() != "cpu":
        return f"JAX runs on {jax.default_backend()}, not cpu"
    return native_cpu.load_ffi(SOURCE, "DenseCpu", TARGET, FLAGS)


def available() -> bool:
    """True when `matmul` can run here."""
    return unavailable_reason() is None


def is_packed(kernel: jax.Array) -> bool:
    """Whether a dense layer's kernel is `pack`'s panels rather than the plain [K, N] matrix."""
    return kernel.ndim != 2


@jax.jit
def pack(kernel: jax.Array) -> jax.Array:
    """A dense layer's kernel as `matmul`'s 16-column panels (done once, at model load).

    Panel p holds columns 16p .. 16p + 15, K-major, so the kernel reads each as one contiguous
    stream; bf16 panels pair consecutive K rows per column (the bf16 dot instructions' operand
    order). Padding (columns past N, rows past K) is zeros.

    Args:
      kernel: [K, N] float32 or bfloat16.

    Returns:
      float32 [P, K, 16], or for bfloat16 its uint16 bits [P, Kp/2, 16, 2]; P = ceil(N / 16),
      Kp = K rounded up to a multiple of 32 (one AMX tile of K).

    Raises:
      ValueError for another rank or dtype.
    """
    if kernel.ndim != 2 or kernel.dtype not in PACKED_DTYPES:
        raise ValueError(f"kernel: expected a float32 or bfloat16 [K, N] matrix, got {kernel.dtype}{list(kernel.shape)}")
    k, n = kernel.shape
    panels = -(-n // LANES)
    w = jnp.pad(kernel, ((0, 0), (0, panels * LANES - n)))
    if kernel.dtype == jnp.float32:
        return w.reshape(k, panels, LANES).transpose(1, 0, 2)
    w = jnp.pad(w, ((0, -k % BF16_K_MULTIPLE), (0, 0)))  # [Kp, P * 16]
    w = w.reshape(-1, 2, panels, LANES).transpose(2, 0, 3, 1)  # [P, Kp/2, 16, 2]
    return jax.lax.bitcast_convert_type(w, jnp.uint16)


def packed_in_features(packed: jax.Array) -> int:
    """K of a packed kernel (bf16: K rounded up to a multiple of 32)."""
    return packed.shape[1] * (2 if packed.ndim == 4 else 1)


@functools.partial(jax.jit, static_argnames=("out_features", "bf16_path"))
def matmul(x: jax.Array, packed: jax.Array, bias: jax.Array | None = None, *, out_features: int,
           bf16_path: str = "auto", rows_in_use: jax.Array | None = None) -> jax.Array:
    """x . W (+ bias) by the native kernel, W given as `pack(W)`.

    The semantics of `nnx.Linear` with `preferred_element_type=float32` (the models' dense layers):
    x is rounded to the weights' dtype, products are accumulated in float32, the bias (in the
    weights' dtype) is added to the float32 sum. Only the summation order differs from XLA's dot.

    Args:
      x: [..., K] activations (any float dtype).
      packed: `pack(W)` of W [K, N]: float32 [P, K, 16] or uint16 [P, Kp/2, 16, 2].
      bias: [N] or None.
      out_features: N (the panels pad it to a multiple of 16).
      bf16_path: bf16 weights take AMX where the CPU has it, else AVX-512 BF16, else widen to
        float32 in registers; "avx512_bf16" or "widen" caps that (so the tests run every path).
      rows_in_use: i32[] (data, not a static shape): only the first this many rows of x [M, K]
        (its leading axes flattened) are computed, the others are zeros in the result; None: all.

    Returns:
      float32 [..., N].

    Raises:
      RuntimeError when the kernel is unavailable here; ValueError for arguments that do not fit.
    """
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"native CPU dense kernel is unavailable: {reason}")
    if packed.dtype not in PACKED_DTYPES.values() or packed.ndim != (4 if packed.dtype == jnp.uint16 else 3):
        raise ValueError(f"packed: expected `pack`'s float32 [P, K, 16] or uint16 [P, K/2, 16, 2], got "
                         f"{packed.dtype}{list(packed.shape)}")
    if packed.shape[0] != -(-out_features // LANES):
        raise ValueError(f"out_features: {out_features} needs {-(-out_features // LANES)} panels, packed has "
                         f"{packed.shape[0]}")
    k, lead = x.shape[-1], x.shape[:-1]
    if bf16_path not in BF16_PATHS:
        raise ValueError(f"bf16_path: one of {list(BF16_PATHS)}, got {bf16_path!r}")
    if (k if packed.ndim == 3 else k + -k % BF16_K_MULTIPLE) != packed_in_features(packed):
        raise ValueError(f"x: last axis {k} does not match the packed kernel's K {packed_in_features(packed)}")
    rows = x.reshape(-1, k)  # [M, K]
    if packed.dtype == jnp.uint16:  # bf16 weights: x rounded to bf16, passed as bits, K padded like W
        rows = jnp.pad(rows.astype(jnp.bfloat16), ((0, 0), (0, packed_in_features(packed) - k)))
        rows = jax.lax.bitcast_convert_type(rows, jnp.uint16)
    else:
        rows = rows.astype(jnp.float32)
    bias = jnp.zeros((0,), jnp.float32) if bias is None else bias.astype(jnp.float32)  # [N], or [0]: none
    in_use = jnp.full((1,), rows.shape[0], jnp.int32) if rows_in_use is None else \
        jnp.reshape(rows_in_use, (1,)).astype(jnp.int32)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows.shape[0], out_features), jnp.float32))
    return call(rows, packed, bias, in_use, bf16_path=np.int32(BF16_PATHS[bf16_path])).reshape(*lead, out_features)
