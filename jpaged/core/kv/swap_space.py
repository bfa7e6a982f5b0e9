"""Swap space: the host pool that preempted groups' blocks move to and come back from (paper §4.5).

A group is swapped out whole: every distinct device block of its sequences is copied once to a
host block (a block shared inside the group stays shared on the host, with the same count), the
sequences give up their rows and device references, and each keeps a host table (its host blocks
and token count). Swapping in reverses it into fresh device blocks and rows. The moves return the
(src, dst) block pairs the executor copies before the step.

The pool also serves the prefix cache's host tier (`jpaged.core.kv.host_tier`, when there is one):
its blocks are unreferenced, so a swap-out takes them back when free blocks run short; they
count as free here. With a tier, a host block freed while the step being scheduled may still
read it (a swap-in, a promotion) or write it (an offload) waits for the next step (`settle`):
the executor runs a step's copies out before its copies in, so it must not be reused in the
same step. Without a tier nothing is copied out after a swap-in in one step, and blocks are
free at once. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

import numpy as np

from jpaged.core.kv.row_store import RowStore, int32_cells


class DevicePool(Protocol):
    """What the swap space needs of the device side (the paged `BlockManager`)."""

    rows: RowStore
    refcount: np.ndarray  # i32[N] references of each device block
    watermark_blocks: int  # free blocks kept by default when swapping in

    @property
    def num_free_blocks(self) -> int:
        """Device blocks a sequence could take now."""

    def take_block(self) -> int:
        """A free device block (the caller sets its count)."""

    def release_blocks(self, blocks: list[int]) -> None:
        """Drops one reference of each (distinct) block."""

    def clear_row(self, row: int) -> None:
        """Zeroes and frees a row its sequence gave up."""


class CachedBlocks(Protocol):
    """What the swap space asks of the prefix cache's host tier (`jpaged.core.kv.host_tier.HostTier`)."""

    @property
    def num_blocks(self) -> int:
        """Host blocks the tier holds (all of them evictable)."""

    def evict(self, count: int) -> list[int]:
        """Drops up to `count` of its blocks; returns them (the caller owns them now)."""


class SwapSpace:
    """Host blocks, their reference counts and the host tables of swapped-out sequences."""

    def __init__(self, device: DevicePool, num_blocks: int, swaps: bool = True):
        """`num_blocks` host blocks, the host tier's included; `swaps` False (cache.num_host_blocks
        = 0): groups never swap out, the pool is the host tier's alone."""
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.device = device  # the device pool the blocks move between
        self.num_blocks = num_blocks  # host blocks, the host tier's included
        self.swaps = swaps and num_blocks > 0  # preempted groups may swap out
        self._refs, self.refcount = int32_cells((num_blocks,))  # [H] references from host tables
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: the lowest id first
        self.tier: CachedBlocks | None = None  # the prefix cache's host tier, set by its block manager
        self._settling: list[int] = []  # with a tier: blocks freed in the step being scheduled
        self._tables: dict[int, tuple[list[int], int]] = {}  # swapped seq id -> (host blocks, tokens)
        # Seq ids swapped out together -> their distinct host blocks: a group is usually retried
        # every step until it fits, so its count is remembered while all of them stay swapped.
        self._sets: dict[tuple[int, ...], int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Host blocks no swapped sequence holds: free ones, and the host tier's (as good as free)."""
        return len(self._free) + len(self._settling) + (self.tier.num_blocks if self.tier is not None else 0)

    @property
    def num_unused_blocks(self) -> int:
        """Host blocks free for taking now (neither swapped out, cached, nor freed this step)."""
        return len(self._free)

    def take_unused(self) -> int:
        """A free host block (the host tier's; the caller checked `num_unused_blocks`)."""
        return self._free.pop()

    def release_later(self, block: int) -> None:
        """Frees a host block once the next step is scheduled (`settle`)."""
        self._settling.append(block)

    def settle(self) -> None:
        """Frees the blocks released in the last step (called as a step starts being scheduled)."""
        if self._settling:
            self._free += self._settling
            self._settling.clear()

    def holds(self, seq_id: int) -> bool:
        """True when `seq_id` is swapped out (holds host blocks)."""
        return seq_id in self._tables

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the host pool has room for every distinct block of these resident sequences
        (never without swap space)."""
        if not self.swaps:
            return False
        blocks, _ = _unique_blocks(self.device.rows.table, seq_ids)
        return len(blocks) <= len(self._free) + (self.tier.num_blocks if self.tier is not None else 0)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Moves a group's sequences to host memory, all or nothing; returns (device, host) copy pairs.

        A block shared inside the group is copied once and stays shared on the host. A block also
        referenced outside the group keeps its device copy for those references.
        """
        if not self.swaps:
            raise ValueError("cannot swap out: no swap space (cache.num_host_blocks = 0)")
        device, rows = self.device, self.device.rows
        for s in seq_ids:
            rows.row_of(s)
        blocks, counts = _unique_blocks(rows.table, seq_ids)
        short = len(blocks) - len(self._free)
        if short > 0:  # the host tier gives back cached blocks (its leaves: never a swapped one)
            if self.tier is None or self.tier.num_blocks < short:
                raise ValueError(f"cannot swap out: {len(blocks)} blocks needed, {self.num_free_blocks} host "
                                 f"blocks free")
            self._free += self.tier.evict(short)
        host_of = {}
        for block, count in zip(blocks.tolist(), counts.tolist()):
            host = self._free.pop()
            self._refs[host] = count
            host_of[block] = host
        for s in seq_ids:
            row = rows.pop(s)
            blocks = rows.blocks_of(row)
            self._tables[s] = ([host_of[b] for b in blocks], rows.token_cells[row])
            device.release_blocks(blocks)
            device.clear_row(row)
        self._sets[tuple(seq_ids)] = len(host_of)
        return list(host_of.items())

    def blocks_needed(self, seq_ids: list[int]) -> int:
        """Distinct host blocks of these swapped sequences: device blocks they need to come back."""
        num_blocks = self._sets.get(tuple(seq_ids))
        if num_blocks is None:
            num_blocks = len(_unique_blocks(lambda s: self._tables[s][0], seq_ids)[0])
        return num_blocks

    def can_swap_in(self, seq_ids: list[int], extra_blocks: int = 0, headroom: int | None = None) -> bool:
        """Whether the device pool has room for these swapped sequences plus `extra_blocks`, keeping
        `headroom` blocks free (default: the device's watermark)."""
        headroom = self.device.watermark_blocks if headroom is None else headroom
        return self.blocks_needed(seq_ids) + extra_blocks <= self.device.num_free_blocks - headroom

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Brings a group's swapped sequences back to the device; returns (host, device) copy pairs."""
        device, rows = self.device, self.device.rows
        for s in seq_ids:
            if s not in self._tables:
                raise KeyError(f"sequence {s} is not swapped out")
        blocks, counts = _unique_blocks(lambda s: self._tables[s][0], seq_ids)
        if len(blocks) > device.num_free_blocks:
            raise ValueError(f"cannot swap in: {len(blocks)} blocks needed, {device.num_free_blocks} free")
        self._forget_sets(seq_ids)
        device_of = {}
        for host, count in zip(blocks.tolist(), counts.tolist()):
            block = device.take_block()
            device.refcount[block] = count
            device_of[host] = block
        for s in seq_ids:
            host_blocks, num_tokens = self._tables.pop(s)
            row = rows.take(s)
            rows.block_tables[row, : len(host_blocks)] = [device_of[h] for h in host_blocks]
            rows.block_cells[row] = len(host_blocks)
            rows.token_cells[row] = num_tokens
            self._release(host_blocks)
        return list(device_of.items())

    def free(self, seq_id: int) -> None:
        """Drops a swapped sequence's host references; blocks whose count reaches 0 become free."""
        host_blocks, _ = self._tables.pop(seq_id)
        self._forget_sets([seq_id])
        self._release(host_blocks)

    def _forget_sets(self, seq_ids: Iterable[int]) -> None:
        """Drops the remembered block counts of every swapped set naming one of `seq_ids` (it no
        longer holds exactly those blocks)."""
        gone = set(seq_ids)
        for key in [k for k in self._sets if not gone.isdisjoint(k)]:
            del self._sets[key]

    def _release(self, blocks: list[int]) -> None:
        """Decrements each host block once (distinct blocks) and frees those that reach 0 (with a
        host tier, from the next step on: this one may read them)."""
        refs = self._refs
        free = self._free if self.tier is None else self._settling
        for block in blocks:
            refs[block] -= 1
            if not refs[block]:
                free.append(block)


def _unique_blocks(table_of: Callable[[int], list[int] | np.ndarray], seq_ids: list[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The distinct blocks of these sequences' tables (ascending) and how many tables hold each."""
    blocks = np.concatenate([np.asarray(table_of(s), dtype=np.int64) for s in seq_ids])
    return np.unique(blocks, return_counts=True)
