"""Buddy allocator over a contiguous unit space, and Orca's reservation policies (paper §6.1).

Orca keeps each request's KV cache in one contiguous region; the paper assumes a buddy allocator
places it. Units are whatever the caller chooses (KV slots or blocks). The space need not be a
power of two: it is cut into maximal aligned power-of-two top blocks (13 units -> [0,8) [8,12)
[12,13)), and buddies never merge across them — the buddy of a top block of size 2^t starts where
only smaller top blocks remain, so it is never free at size 2^t.
"""

from __future__ import annotations

import heapq
from typing import Literal

Policy = Literal["oracle", "pow2", "max"]


def order_of(size: int) -> int:
    """Smallest k with 2^k >= size (size >= 1): the order a request of `size` units is served at."""
    return (size - 1).bit_length()


class BuddyAllocator:
    """Classic binary buddy allocation: requests round up to a power of two; lowest address first.

    Every operation is O(log n): a free list per order (a set, plus a min-heap of offsets with lazy
    deletion so the lowest free address of an order is found in O(log n)).
    """

    def __init__(self, num_units: int) -> None:
        if num_units < 1:
            raise ValueError(f"num_units must be >= 1, got {num_units}")
        self.num_units = num_units
        self.max_order = num_units.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]  # free offsets per order
        self._heaps: list[list[int]] = [[] for _ in range(self.max_order + 1)]  # same offsets, min-heap, may hold stale ones
        self._allocated: dict[int, int] = {}  # offset -> order of each live allocation
        self._free_units = num_units
        offset = 0
        for order in range(self.max_order, -1, -1):  # top blocks, largest first
            if num_units >> order & 1:
                self._push(order, offset)
                offset += 1 << order

    def _push(self, order: int, offset: int) -> None:
        self._free[order].add(offset)
        heap = self._heaps[order]
        heapq.heappush(heap, offset)
        if len(heap) > 2 * len(self._free[order]) + 64:  # too many stale entries: rebuild (amortized O(1))
            self._heaps[order] = sorted(self._free[order])

    def _pop_lowest(self, order: int) -> int:
        free, heap = self._free[order], self._heaps[order]
        while True:
            offset = heapq.heappop(heap)
            if offset in free:
                free.remove(offset)
                return offset

    def can_allocate(self, size: int) -> bool:
        """True when `allocate(size)` would succeed now."""
        k = order_of(size)
        return any(self._free[o] for o in range(k, self.max_order + 1))

    def allocate(self, size: int) -> int | None:
        """Offset of a new region of 2^order_of(size) units, or None when no free block is big enough.

        The 2^k - size units past the request are internal fragmentation of this allocation.
        """
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        k = order_of(size)
        order = next((o for o in range(k, self.max_order + 1) if self._free[o]), None)
        if order is None:
            return None
        offset = self._pop_lowest(order)
        while order > k:  # split, keeping the lower half and freeing the upper buddy
            order -= 1
            self._push(order, offset + (1 << order))
        self._allocated[offset] = k
        self._free_units -= 1 << k
        return offset

    def free(self, offset: int) -> None:
        """Returns the region at `offset` and merges it with free buddies as far as possible."""
        if offset not in self._allocated:
            raise ValueError(f"offset {offset} is not the start of a live allocation")
        order = self._allocated.pop(offset)
        self._free_units += 1 << order
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)  # its heap entry goes stale
            offset = min(offset, buddy)
            order += 1
        self._push(order, offset)

    def allocated_size(self, offset: int) -> int:
        """Units held by the live allocation at `offset` (a power of two)."""
        if offset not in self._allocated:
            raise ValueError(f"offset {offset} is not the start of a live allocation")
        return 1 << self._allocated[offset]

    @property
    def free_units(self) -> int:
        """Units in free blocks."""
        return self._free_units

    @property
    def num_allocations(self) -> int:
        """Live allocations."""
        return len(self._allocated)

    def largest_free_block(self) -> int:
        """Units of the largest free block: the biggest request that can succeed now (0 if full)."""
        return next((1 << o for o in range(self.max_order, -1, -1) if self._free[o]), 0)

    def external_fragmentation(self, size: int) -> int:
        """Free units that cannot serve a request of `size` units: those in free blocks smaller than
        2^order_of(size). Exact, since a buddy request is served by one free block of at least its
        order, never by a union of smaller ones. All free units when size exceeds the space.
        """
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        k = min(order_of(size), self.max_order + 1)
        return sum(len(self._free[o]) << o for o in range(k))

    def free_blocks(self) -> list[tuple[int, int]]:
        """(offset, units) of every free block, by offset."""
        return sorted((off, 1 << o) for o, offsets in enumerate(self._free) for off in offsets)


def reservation(policy: Policy, prompt_len: int, output_len: int, max_len: int = 2048) -> int:
    """KV units Orca reserves for a request, per the paper's §6.1 policies.

    oracle: prompt + true output length. pow2: prompt + the output length rounded up to a power of
    two ("over-reserves the space for outputs by at most 2x": 25 -> 32), capped at max_len, the
    longest a sequence can grow. max: max_len (2048 for OPT), whatever the request.
    """
    if prompt_len < 1 or output_len < 1 or prompt_len + output_len > max_len:
        raise ValueError(f"prompt_len and output_len must be >= 1 with prompt_len + output_len <= "
                         f"max_len ({max_len}), got {prompt_len} + {output_len}")
    if policy == "oracle":
        return prompt_len + output_len
    if policy == "pow2":
        return min(prompt_len + (1 << order_of(output_len)), max_len)
    if policy == "max":
        return max_len
    raise ValueError(f"policy must be 'oracle', 'pow2' or 'max', got {policy!r}")
