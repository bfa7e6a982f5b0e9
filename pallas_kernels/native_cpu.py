"""Native CPU attention: a C++ XLA FFI custom call, compiled on first use, beside the XLA paths.

On XLA:CPU a dot cannot read the KV pool through a block table: the XLA paths
(`paged_attention_xla`, `paged_prefill_attention_xla`) gather every page into a copy and run
small batched dots over it.
`native/paged_attention_cpu.cc` reads each live K/V row where it lies in the pool (float32, or
bfloat16 stored as uint16 bits), one query row at a time with a per-page online softmax in
float32 (a vector of keys at a time for head dims 32, 64 and 128 on AVX2 and AVX-512), spread
over XLA's intra-op threads. Decode (`paged_attention_cpu`) and prefill
(`paged_prefill_attention_cpu`, causal with the cached-context offset) are the same kernel: each
row attends to the first `row_keys` tokens of its sequence. Oracles: the plain-jnp references
(tests/pallas_kernels/test_native_cpu.py).

The source is compiled once per machine with the C++ compiler found (`CXX`, else `c++`/`g++`),
`-O3 -march=native`, against the FFI headers jaxlib ships (`jax.ffi.include_dir()`), into
`$JPAGED_CACHE_DIR` (default `~/.cache/jpaged`), named by a hash of the source, flags, jax version
and CPU; later processes load the cached library. `available()` says whether it loaded; without
a compiler the XLA path runs instead (`paged_attention.select_impl`), and `JPAGED_NATIVE_CPU=0`
turns the native kernel off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import (
    as_bits,
    check_decode_shapes,
    check_prefill_shapes,
    token_positions,
)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native") / "paged_attention_cpu.cc"
TARGET = "jpaged_paged_attention_cpu"
# -fopenmp-simd: the source's `omp simd` loops vectorise (no OpenMP runtime); -fno-math-errno lets
# the page's exp() loop call the vector math library; 512-bit vectors where the CPU has them.
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fopenmp-simd", "-std=c++20",
         "-shared", "-fPIC")


def _compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else the first of c++, g++, clang++ on PATH."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags (Linux), else the machine name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.machine()


def _library_path(compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    """Where the library built from `source` with `compiler` and `flags` for this CPU and jax lives."""
    key = hashlib.sha256("\0".join([source.read_text(), compiler, *flags, jax.__version__, _cpu_id()]).encode())
    cache = Path(os.environ.get("JPAGED_CACHE_DIR", Path.home() / ".cache" / "jpaged"))
    return cache / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _build(compiler: str, source: Path, flags: tuple[str, ...], out: Path) -> None:
    """Compile `source` into `out` (atomically: concurrent processes never load a half-written file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), str(source), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, out)


@functools.cache
def load_ffi(source: Path, symbol: str, target: str, flags: tuple[str, ...] = FLAGS) -> str | None:
    """Builds `source` (if not cached), loads it and registers its handler as a CPU custom call.

    Shared by every native CPU kernel; cached per process, so each library loads once.

    Args:
      source: the C++ file.
      symbol: the exported XLA FFI handler in it.
      target: the custom call's name (`jax.ffi.ffi_call(target, ...)`).
      flags: compiler flags (part of the cached library's name).

    Returns:
      None when registered, else why the kernel is not available (no compiler, build or load
      failure, JPAGED_NATIVE_CPU=0).
    """
    if os.environ.get("JPAGED_NATIVE_CPU", "1") == "0":
        return "JPAGED_NATIVE_CPU=0"
    compiler = _compiler()
    if compiler is None:
        return "no C++ compiler found (set CXX)"
    path = _library_path(compiler, source, flags)
    try:
        if not path.is_file():
            _build(compiler, source, flags, path)
        library = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as error:
        logger.warning("native CPU kernel %s unavailable, using the XLA path: %s", source.name, error)
        return str(error)
    return None


def available() -> bool:
    """True when the native attention kernel is built and registered (and JAX runs on CPU)."""
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """None when `available()`, else why not (builds and loads the kernel on first call)."""
    if jax.default_backend() != "cpu":
        return f"JAX runs on {jax.default_backend()}, not cpu"
    return load_ffi(SOURCE, "PagedAttentionCpu", TARGET)


def _attend(q, k_pages, v_pages, block_tables, row_seq, row_keys, layer, scale: float) -> jax.Array:
    """The custom call on checked arguments: pools a layer stack, q [T, Hq, D], row_* i32[T]."""
    if not available():
        raise RuntimeError(f"native CPU attention is unavailable: {unavailable_reason()}")
    if k_pages.dtype not in (jnp.float32, jnp.bfloat16, jnp.uint16):
        raise ValueError(f"k_pages: the native CPU kernel reads float32 or bfloat16 (or its uint16 bits) pools, "
                         f"got {k_pages.dtype}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), as_bits(k_pages), as_bits(v_pages), block_tables, row_seq.astype(jnp.int32),
               row_keys.astype(jnp.int32), layer.reshape(1), scale=np.float32(scale))
    return out.astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_cpu(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, D]
    """Paged decode attention by the native kernel; the contract of `paged_attention_reference`.

    Pools of float32, or bfloat16 (as its uint16 bits, or bf16 itself: bitcast here, which on
    XLA:CPU copies the pool; the engine stores bits).

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`; float32, bfloat16 or bfloat16's uint16 bits.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[B, M] each sequence's physical blocks, in order.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.

    Raises:
      RuntimeError when the kernel is unavailable here (`unavailable_reason`); ValueError naming
      an argument that does not fit.
    """
    k_pages, v_pages, layer = check_decode_shapes(q, k_pages, v_pages, block_tables, context_lens, layer)
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)  # row b is sequence b and sees its whole context
    return _attend(q, k_pages, v_pages, block_tables, rows, context_lens, layer, scale)


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_prefill_attention_cpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, D]
    """Paged prefill attention by the native kernel; the contract of `paged_prefill_attention_reference`
    (ragged query chunks, causal with the cached-context offset).

    Args:
      q: [T, Hq, D] the batch's query tokens, sequence by sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`; float32, bfloat16 or bfloat16's uint16 bits.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[S, M] each sequence's physical blocks, in order.
      context_lens: i32[S] tokens of each sequence, its query tokens included (0: padding).
      query_start_loc: i32[S + 1] sequence s owns query rows [query_start_loc[s],
        query_start_loc[s + 1]), the last tokens of its context.
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).

    Returns:
      [T, Hq, D] in q.dtype (accumulated in float32); zeros for rows no sequence owns.

    Raises:
      RuntimeError when the kernel is unavailable here (`unavailable_reason`); ValueError naming
      an argument that does not fit.
    """
    k_pages, v_pages, layer = check_prefill_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                                                   layer)
    seq_ids, positions, valid = token_positions(query_start_loc, context_lens, q.shape[0])  # [T] each
    # Causal: row t sees its sequence's tokens 0 .. positions[t] (never past the context).
    row_keys = jnp.where(valid, jnp.minimum(positions + 1, context_lens[seq_ids]), 0)
    return _attend(q, k_pages, v_pages, block_tables, seq_ids, row_keys, layer, scale)
