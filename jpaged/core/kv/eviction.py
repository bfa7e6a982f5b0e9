"""Eviction policies of the prefix cache's tiers: which unreferenced cached block goes first.

The radix tree (`jpaged.core.kv.prefix_cache`) decides which blocks may go (a tier's candidates: on
the device, cached blocks no sequence references and no device block hangs below; on the host,
leaves) and tells its tier's policy as they come and go; the policy only orders them. Both tiers
take any `EvictionPolicy` (`cache.eviction_policy`):

- `lru`: least recently released first (a block's last use is when its last reference went away);
  a parent that becomes a candidate queues behind the blocks released before it, so a shared
  prefix outlives the tails below it.
- `arc`: Adaptive Replacement Cache (Megiddo and Modha, FAST'03), as vLLM's CPU offloading manager
  runs it: candidates used once (T1) and candidates reused by a prefix hit since they were cached
  (T2; the reuse follows the content from tier to tier), each in LRU order; evicted content
  leaves a ghost (its digest) in B1 / B2, and when it comes back (computed, offloaded or
  promoted again) T1's target size moves towards the list that lost it. The victim comes from
  T1 while T1 holds more than its target, else from T2.

Policies see block ids, whether a block's content was reused, and content digests (ids are reused
once a block leaves its tier: ghosts need the content's identity). Pure Python: no numpy or jax.
"""

from __future__ import annotations

import collections
from typing import Protocol

POLICIES = ("lru", "arc")  # the names `cache.eviction_policy` takes


class EvictionPolicy(Protocol):
    """The order in which one tier evicts its candidates."""

    tracks_content: bool  # whether it wants digests (`left`, `entered`): the tree computes them only then

    def add(self, block: int, reused: bool) -> None:
        """`block` became a candidate (a cached block nobody needs, removable now); `reused`: a
        prefix hit used its content since it was first cached (in either tier)."""

    def discard(self, block: int) -> None:
        """`block` is no longer a candidate (referenced again, or gone); a no-op if it was not one."""

    def victim(self) -> int | None:
        """Removes and returns the next candidate to evict (None when there is none). The tree may
        find it stale and ask again."""

    def left(self, digest: int | None, reused: bool) -> None:
        """Content `digest` (None unless `tracks_content`) left the tier for good or for the
        other tier; `reused` as for `add`."""

    def entered(self, digest: int | None) -> None:
        """Content `digest` (None unless `tracks_content`) entered the tier."""


class LRUPolicy:
    """Least recently released first (see the module docstring)."""

    tracks_content = False

    def __init__(self) -> None:
        # Candidates, oldest first: assigning an existing key keeps its place (OrderedDict).
        self._order: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, block: int, reused: bool) -> None:
        """Queues `block` last (a block already queued keeps its place)."""
        self._order[block] = None

    def discard(self, block: int) -> None:
        """Unqueues `block`."""
        self._order.pop(block, None)

    def victim(self) -> int | None:
        """The oldest candidate."""
        return self._order.popitem(last=False)[0] if self._order else None

    def left(self, digest: int | None, reused: bool) -> None:
        """Nothing to remember."""

    def entered(self, digest: int | None) -> None:
        """Nothing to learn."""


class ARCPolicy:
    """Adaptive Replacement Cache over a tier's candidates (see the module docstring)."""

    tracks_content = True

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (the tier's blocks), got {capacity}")
        self.capacity = capacity  # the tier's blocks: the most ghosts each list keeps, the largest target
        self.target = 0  # T1's target size (ARC's p): grows when T1's ghosts come back, shrinks for T2's
        self._once: collections.OrderedDict[int, None] = collections.OrderedDict()  # T1 candidates, oldest first
        self._reused: collections.OrderedDict[int, None] = collections.OrderedDict()  # T2 candidates
        self._ghosts_once: collections.OrderedDict[int, None] = collections.OrderedDict()  # B1: digests
        self._ghosts_reused: collections.OrderedDict[int, None] = collections.OrderedDict()  # B2: digests

    def __len__(self) -> int:
        return len(self._once) + len(self._reused)

    def add(self, block: int, reused: bool) -> None:
        """Queues `block` last in T2 if its content was reused, else in T1."""
        (self._reused if reused else self._once)[block] = None

    def discard(self, block: int) -> None:
        """Unqueues `block` from either list."""
        self._once.pop(block, None)
        self._reused.pop(block, None)

    def victim(self) -> int | None:
        """The oldest of T1 while T1 is over its target (or T2 is empty), else the oldest of T2."""
        if self._once and (len(self._once) > self.target or not self._reused):
            return self._once.popitem(last=False)[0]
        if self._reused:
            return self._reused.popitem(last=False)[0]
        return None

    def left(self, digest: int | None, reused: bool) -> None:
        """Leaves a ghost of the content in B2 (it was reused) or B1, the oldest ghost going past capacity."""
        ghosts = self._ghosts_reused if reused else self._ghosts_once
        ghosts[digest] = None
        ghosts.move_to_end(digest)
        if len(ghosts) > self.capacity:
            ghosts.popitem(last=False)

    def entered(self, digest: int | None) -> None:
        """Evicted content came back: T1's target moves towards the list that lost it (by ARC's
        step: 1, or the ratio of the other ghost list's length to this one's when larger)."""
        once, reused = self._ghosts_once, self._ghosts_reused
        if digest in once:
            self.target = min(self.target + max(1, len(reused) // len(once)), self.capacity)
            del once[digest]
        elif digest in reused:
            self.target = max(self.target - max(1, len(once) // len(reused)), 0)
            del reused[digest]


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called `name` (`POLICIES`) for a tier of `capacity` blocks; ValueError otherwise."""
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy(max(capacity, 1))
    raise ValueError(f"cache.eviction_policy: must be one of {', '.join(POLICIES)}, got {name!r}")
