"""Launch shapes chosen per call (splits, warps) and knobs checked against the target's limits.

The attention kernels share one structure: a program holds a query tile of `rows` rows, streams
`block_k` keys per step and keeps a flash-style accumulator. Its resource use follows from that:

- Shared memory (`Tile.shared_bytes`), fitted to what Triton allocates for sm_80 and sm_90
  (tests/pallas_kernels/test_kernels_compile.py compiles the kernels with the `triton` package's
  ptxas and checks the model is never below the truth and at most one P tile + 1 KB above it):
  the query tile, the K/V chunk buffers
  (one with `num_stages=1`; software pipelining keeps three, or four for Hopper's warpgroup dots
  on >= 64-row tiles), and the P tile feeding the second dot (which warpgroup dots read from
  registers). The one-row decode path has no dot: its loads stay in registers.
- Registers (`Tile.num_warps`): the live f32 accumulator and score tiles plus a K/V chunk per
  thread; the fewest warps that keep that at <= 64 words per thread compile without spills at
  every bf16/f16 shape the compile test covers (about 64-250 registers). f32 inputs (the GPU
  correctness tests) count double: their dots run in full precision on the FMA units with the
  operands in registers.
- Splits (`choose_num_splits`): enough context splits that the grid fills the GPU at least twice
  over (two waves), counting the programs each SM holds at once (bounded by shared memory,
  registers at ~128 per thread, warps and the 32-program cap), at most one split per key chunk.
"""

from __future__ import annotations

import dataclasses
import math

from pallas_kernels.targets import GpuTarget

WARP_CHOICES = (4, 8, 16)
WORDS_PER_THREAD = 64  # live f32 words per thread that compile without spills (see module docstring)
REGISTERS_PER_THREAD = 128  # what such tiles compile to (64-250 in the compile table), for residency
MIN_WAVES = 2
MAX_STAGES = 3


@dataclasses.dataclass(frozen=True)
class Tile:
    """What one program of an attention kernel holds: a query tile of `rows` rows of `head_dim`."""

    rows: int
    head_dim: int
    itemsize: int  # bytes per element of q / K / V
    dots: bool = True  # False: the one-row decode path, which multiplies and reduces instead

    def shared_bytes(self, *, block_k: int, num_stages: int, num_warps: int, capability: int) -> int:
        """The shared memory one program needs on sm_`capability`, in bytes (module docstring)."""
        if not self.dots:
            return 256 * num_warps  # loads stay in registers; only the reductions' scratch
        wgmma = capability >= 90 and self.rows >= 64  # Hopper's warpgroup dot reads P from registers
        buffers = 1 if num_stages == 1 else (4 if wgmma else 3)
        q_tile = self.rows * self.head_dim * self.itemsize
        p_tile = 0 if wgmma else self.rows * block_k * self.itemsize
        # + 256 B: the pipeliner's barriers and the reductions' scratch.
        return q_tile + buffers * block_k * self.head_dim * self.itemsize + p_tile + 256

    def num_warps(self, *, block_k: int) -> int:
        """Fewest warps that keep the live tiles at <= WORDS_PER_THREAD f32 words per thread."""
        words = self.rows * self.head_dim + self.rows * block_k + block_k * self.head_dim * self.itemsize / 4
        if self.itemsize == 4:
            words *= 2
        for warps in WARP_CHOICES:
            if words / (32 * warps) <= WORDS_PER_THREAD:
                return warps
        return WARP_CHOICES[-1]


def resident_programs(target: GpuTarget, *, smem: int, num_warps: int) -> int:
    """Programs of one kernel an SM holds at once (shared memory, registers, warps, the program cap)."""
    by_registers = target.regs_per_sm // (REGISTERS_PER_THREAD * 32 * num_warps)
    return max(1, min(target.max_programs_per_sm, target.smem_per_sm // max(smem, 1), by_registers,
                      target.max_warps_per_sm // num_warps))


def choose_num_splits(target: GpuTarget, *, programs_per_split: int, num_chunks: int, smem: int,
                      num_warps: int) -> int:
    """Context splits so the grid is >= MIN_WAVES waves of the target, at most one per key chunk.

    Splits hold whole chunks, equally many each (a static `pages_per_split`), so the count is
    rounded up to the next that divides the chunks evenly: never fewer waves than asked for.
    """
    slots = target.num_sms * resident_programs(target, smem=smem, num_warps=num_warps)
    wanted = min(math.ceil(MIN_WAVES * slots / max(programs_per_split, 1)), num_chunks)
    chunks_per_split = max(1, num_chunks // max(wanted, 1))
    return math.ceil(num_chunks / chunks_per_split)


def check_launch(kernel: str, target: GpuTarget, tile: Tile, *, block_k: int, num_stages: int,
                 num_warps: int) -> int:
    """Raise ValueError naming the knob when a launch exceeds `target`'s per-program limits.

    Returns the program's shared memory estimate. A `block_k` too large for the shared memory is
    refused with the largest power of two that fits at this `num_stages`.
    """
    if num_warps not in (1, 2, 4, 8, 16, 32) or num_warps > target.max_warps_per_program:
        raise ValueError(f"num_warps: must be a power of two <= {target.max_warps_per_program}, got {num_warps}")
    if not 1 <= num_stages <= MAX_STAGES:
        raise ValueError(f"num_stages: must be in [1, {MAX_STAGES}] (the shared-memory model is fitted there), "
                         f"got {num_stages}")
    def smem_at(bk: int) -> int:
        return tile.shared_bytes(block_k=bk, num_stages=num_stages, num_warps=num_warps, capability=target.capability)

    smem = smem_at(block_k)
    if smem > target.smem_per_block:
        fits = [bk for bk in (16, 32, 64, 128, 256, 512) if smem_at(bk) <= target.smem_per_block]
        hint = f"the largest that fits is {fits[-1]}" if fits else "no block_k fits: lower num_stages"
        raise ValueError(f"block_k: {kernel} with block_k={block_k}, num_stages={num_stages} needs ~{smem:,} B of "
                         f"shared memory per program; {target.name} ({target.device_kind}) allows "
                         f"{target.smem_per_block:,} B per block ({hint})")
    return smem
