"""Compile the kernels' Triton IR to cubin without a GPU, and read what ptxas made of it.

`lower_triton(fn, *shapes, target=...)` lowers a jitted function for CUDA under an abstract GPU
device and captures the Triton module (TTIR) of every `pallas_call` in it, with the warps and
stages the lowering passes on; `compile_kernel(kernel, target)` compiles one with the `triton`
package (its bundled ptxas) for that target and returns registers, spilled bytes and shared memory.

On a GPU, XLA compiles the same TTIR with the Triton it bundles; the PyPI `triton` is a close
proxy (same pass pipeline from TTIR down, possibly a different Triton version), so these numbers
catch spills and shared-memory overflows before a GPU is ever used, not exact register counts.
Needs the `triton` package (the `test` extra); imported lazily so the kernels never depend on it.

    python -m pallas_kernels.triton_compile   # the compile table of the kernels at serving shapes
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.targets import SUPPORTED, GpuTarget, abstract_gpu


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One `pallas_call` lowered to Triton IR, with the launch parameters the lowering passes on."""

    name: str
    ttir: str  # the module's MLIR text
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """What ptxas reports for one kernel on one target."""

    name: str
    target: str  # "sm_80"
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]
    registers: int  # per thread
    spill_bytes: int  # spill stores + spill loads, bytes per thread
    shared_bytes: int  # dynamic shared memory Triton allocates for one program

    def row(self) -> str:
        """One markdown table row."""
        grid = " x ".join(map(str, self.grid))
        return (f"| {self.name} | {self.target} | {grid} | {self.num_warps} | {self.registers} | {self.spill_bytes} "
                f"| {self.shared_bytes:,} |")


def _backend_configs(stablehlo: str) -> list[tuple[str, int, int]]:
    """(name, num_warps, num_stages) of every Triton custom call, in module order."""
    calls = []
    for line in stablehlo.splitlines():
        if "__gpu$xla.gpu.triton" not in line:
            continue
        fields = {key: re.search(rf"\b{key} = (\"[^\"]*\"|\d+)", line) for key in ("name", "num_warps", "num_stages")}
        if not all(fields.values()):
            raise RuntimeError(f"Triton custom call without name/num_warps/num_stages: {line[:300]}")
        calls.append((fields["name"].group(1).strip('"'), int(fields["num_warps"].group(1)),
                      int(fields["num_stages"].group(1))))
    return calls


def lower_triton(fn, *shapes, target: GpuTarget) -> list[TritonKernel]:
    """Lower `jax.jit(fn)` at `shapes` for CUDA and `target`; the Triton kernels it launches.

    Raises RuntimeError if a `pallas_call` did not go through the Triton lowering.
    """
    from jax._src.pallas.triton import lowering  # the only way to see the TTIR before XLA gets it

    captured: list[tuple[str, tuple[int, ...]]] = []
    original = lowering.lower_jaxpr_to_triton_module

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append((result.module.operation.get_asm(), tuple(result.grid)))
        return result

    lowering.lower_jaxpr_to_triton_module = spy
    jax.clear_caches()  # a cached lowering would skip the spy
    try:
        with abstract_gpu(target):
            text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    calls = _backend_configs(text)
    if len(calls) != len(captured) or not calls:
        raise RuntimeError(f"expected one Triton custom call per captured module, got {len(calls)} calls and "
                           f"{len(captured)} modules")
    return [TritonKernel(name, ttir, grid, warps, stages)
            for (name, warps, stages), (ttir, grid) in zip(calls, captured)]


_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_kernel(kernel: TritonKernel, target: GpuTarget) -> KernelBuild:
    """Compile `kernel` to cubin for `target` with the `triton` package; registers, spills, shared memory."""
    import triton
    from triton import knobs
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    gpu = GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    # FMA fusion on, as XLA compiles Triton kernels.
    options = {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, "enable_fp_fusion": True}
    with tempfile.TemporaryDirectory() as tmp:
        # Run Triton's TTIR passes first (XLA's pipeline starts there too): compiling from a .ttir
        # file would skip them, as for a hand-written IR test.
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        source = Path(tmp, f"{kernel.name}.ttir")
        source.write_text(kernel.ttir)
        module = ir.parse_mlir_module(str(source), context)
        module.context = context  # as triton.compile's IRSource does
        backend.make_ttir(module, {}, backend.parse_options(options), target.capability)
        source.write_text(str(module))
        log = io.StringIO()
        with knobs.nvidia.scope(), knobs.compilation.scope(), knobs.cache.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v output, printed only when it runs ...
            knobs.compilation.always_compile = True  # ... so never answer from Triton's cache
            knobs.cache.dir = str(Path(tmp, "cache"))
            compiled = triton.compile(str(source), target=gpu, options=options)
    text = log.getvalue()
    regs, spills = _REGS.search(text), _SPILLS.search(text)
    if regs is None or spills is None:
        raise RuntimeError(f"{kernel.name}: no register / spill report in the ptxas log:\n{text}")
    return KernelBuild(kernel.name, target.name, kernel.num_warps, kernel.num_stages, kernel.grid,
                       registers=int(regs.group(1)), spill_bytes=int(spills.group(1)) + int(spills.group(2)),
                       shared_bytes=int(compiled.metadata.shared))


def compile_fn(fn, *shapes, target: GpuTarget) -> list[KernelBuild]:
    """`lower_triton` then `compile_kernel` for each kernel `fn` launches."""
    return [compile_kernel(k, target) for k in lower_triton(fn, *shapes, target=target)]


@dataclasses.dataclass(frozen=True)
class Case:
    """A kernel call at fixed shapes: `fn(*shapes)` is what gets lowered."""

    label: str
    fn: Callable
    shapes: tuple[jax.ShapeDtypeStruct, ...]


def _sds(*shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def decode_case(label, *, batch, q_heads, kv_heads, context, block_size=16, head_dim=128, layers=None,
                dtype=jnp.bfloat16, **knobs) -> Case:
    """Paged decode over a pool holding every sequence's context (layer-stacked when `layers`)."""
    from pallas_kernels.paged_attention import paged_attention

    max_blocks = -(-context // block_size)
    pool = (kv_heads, batch * max_blocks + 1, block_size, head_dim)
    pool = _sds(*((layers,) if layers else ()), *pool, dtype=dtype)
    shapes = (_sds(batch, q_heads, head_dim, dtype=dtype), pool, pool, _sds(batch, max_blocks, dtype=jnp.int32),
              _sds(batch, dtype=jnp.int32)) + ((_sds(dtype=jnp.int32),) if layers else ())
    return Case(label, functools.partial(paged_attention, scale=head_dim ** -0.5, **knobs), shapes)


def prefill_case(label, *, tokens, seqs, q_heads, kv_heads, context, block_size=16, head_dim=128, layers=None,
                 pool_blocks=None, dtype=jnp.bfloat16, **knobs) -> Case:
    """Paged prefill of `tokens` query rows over `seqs` sequences of up to `context` tokens."""
    from pallas_kernels.paged_prefill import paged_prefill_attention

    max_blocks = -(-context // block_size)
    pool = (kv_heads, pool_blocks or seqs * max_blocks + 1, block_size, head_dim)
    pool = _sds(*((layers,) if layers else ()), *pool, dtype=dtype)
    shapes = (_sds(tokens, q_heads, head_dim, dtype=dtype), pool, pool, _sds(seqs, max_blocks, dtype=jnp.int32),
              _sds(seqs, dtype=jnp.int32), _sds(seqs + 1, dtype=jnp.int32)) + ((_sds(dtype=jnp.int32),) if layers else ())
    return Case(label, functools.partial(paged_prefill_attention, scale=head_dim ** -0.5, **knobs), shapes)


def contiguous_case(label, *, batch, q_heads, kv_heads, context, head_dim=128, dtype=jnp.bfloat16, **knobs) -> Case:
    """The benchmark's contiguous decode baseline."""
    from pallas_kernels.contiguous_attention import contiguous_attention

    cache = _sds(batch, kv_heads, context, head_dim, dtype=dtype)
    shapes = (_sds(batch, q_heads, head_dim, dtype=dtype), cache, cache, _sds(batch, dtype=jnp.int32))
    return Case(label, functools.partial(contiguous_attention, scale=head_dim ** -0.5, **knobs), shapes)


def serving_cases() -> list[Case]:
    """The kernels at serving shapes, bf16, head_dim 128, block 16, default knobs.

    OPT-13B (40 query / 40 KV heads, 40 layers) and a GQA model (32 / 8, 32 layers), with the
    runner's layer-stacked pools (large enough to need 64-bit offsets). Decode: batch 32 at
    context 2048. Prefill: a 512-token chunk alone (context 512), the same chunk after a
    1536-token cached prefix, and a mixed batch of 31 decode tokens plus a 481-token chunk.
    """
    cases = []
    for model, (hq, hkv, layers) in {"opt13b": (40, 40, 40), "gqa32_8": (32, 8, 32)}.items():
        pool_blocks = 32 * 128 + 1  # the decode batch's pool: 32 sequences x 2048 tokens
        cases.append(decode_case(f"decode_{model}_b32_ctx2048", batch=32, q_heads=hq, kv_heads=hkv, context=2048,
                                 layers=layers))
        for label, seqs, context in (("prefill512", 1, 512), ("prefill512_prefix1536", 1, 2048),
                                     ("mixed_31decode_481prefill", 32, 2048)):
            cases.append(prefill_case(f"{label}_{model}", tokens=512, seqs=seqs, q_heads=hq, kv_heads=hkv,
                                      context=context, layers=layers, pool_blocks=pool_blocks))
    cases.append(contiguous_case("contiguous_opt13b_b32_ctx2048", batch=32, q_heads=40, kv_heads=40, context=2048))
    return cases


def main() -> None:
    """Print the compile table of `serving_cases()` for the supported targets."""
    print("| case | kernel | target | grid | warps | registers | spilled B | shared B |\n"
          "|---|---|---|---|---|---|---|---|")
    for case in serving_cases():
        for target in SUPPORTED:
            for build in compile_fn(case.fn, *case.shapes, target=target):
                print(f"| {case.label} {build.row()}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
