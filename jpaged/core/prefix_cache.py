"""A radix tree over full KV blocks: requests that start with the same tokens share those blocks.

A path from a root is a prefix of whole blocks; each node holds the physical block storing that
block of tokens. There is one root per cache salt, so requests with different salts never share
(tenants cannot probe each other's prompts through timing). The block manager owns reference
counts and tells the cache when a cached block loses its last reference (`release_all`) or gains
one again (`touch`): a node whose block has references is locked; a node without references
keeps its block cached (off the free list, in `evictable`) until space is needed, then
unreferenced leaves are evicted, least recently released first. Pure Python: no numpy or jax.
"""

from __future__ import annotations

import collections
from typing import Hashable, Iterable


def block_keys(token_ids: list[int], block_size: int, known: list[tuple[int, ...]] | None = None
               ) -> list[tuple[int, ...]]:
    """Tuples of the token ids of each full block; extends `known` (keys of a prefix) in place if given."""
    keys = [] if known is None else known
    for i in range(len(keys), len(token_ids) // block_size):
        keys.append(tuple(token_ids[i * block_size: (i + 1) * block_size]))
    return keys


class _Node:
    __slots__ = ("key", "block", "parent", "children")

    def __init__(self, key: tuple[int, ...] | None, block: int, parent: _Node | None):
        self.key = key  # the block's token ids (None at a root)
        self.block = block  # physical block id (-1 at a root)
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}


class PrefixCache:
    """Radix tree of full blocks with LRU eviction of unreferenced leaves: it evicts only blocks
    in `evictable` (no live sequence references them), and never hands out a block twice."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._roots: dict[Hashable, _Node] = {}
        self._node_of_block: dict[int, _Node] = {}
        # Cached blocks without references (leaves or not): read-only outside the cache (the block
        # manager counts them as free).
        self.evictable: set[int] = set()
        # Unreferenced leaves, least recently released first: O(1) LRU without timestamps (a
        # block's last use is when its last reference went away). Entries can go stale (a block
        # re-referenced or given children); evict() skips those.
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries

    def __contains__(self, block: int) -> bool:
        return block in self._node_of_block

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held by the tree (referenced or not)."""
        return len(self._node_of_block)

    @property
    def num_evictable(self) -> int:
        """Cached blocks that no sequence references: reclaimable on demand."""
        return len(self.evictable)

    def match(self, keys: list[tuple[int, ...]], salt: Hashable, max_blocks: int) -> list[int]:
        """Physical blocks of the longest cached prefix of whole blocks (at most `max_blocks`).

        `keys[i]` is the tuple of token ids of full block i (see `block_keys`).
        """
        node = self._roots.get(salt)
        blocks: list[int] = []
        for key in keys[:max_blocks]:
            node = node.children.get(key) if node is not None else None
            if node is None:
                break
            blocks.append(node.block)
        return blocks

    # ------------------------------------------------------------------ updates

    def touch(self, blocks: list[int]) -> None:
        """Marks the blocks of a matched prefix as referenced again (not evictable)."""
        for block in blocks:
            self.evictable.discard(block)
            self._lru.pop(block, None)

    def insert(self, keys: list[tuple[int, ...]], blocks: Iterable[int], salt: Hashable,
               resume: tuple[_Node, int] | None = None) -> tuple[_Node, int] | None:
        """Adds the full blocks of a sequence (`blocks[i]` holds the tokens `keys[i]`).

        Where the tree already caches the same tokens in another physical block, insertion stops:
        the tree keeps its first copy, and the sequence's own blocks are freed normally.

        `resume` is what an earlier insert of the same (still resident) sequence returned: its
        first blocks are already in the tree as its own, referenced and so never evicted, and
        `keys` and `blocks` continue the path below them. Returns the same for the next insert
        (the sequence's deepest own node and how many of its blocks are in the tree), or None if
        none is.
        """
        if resume is None:
            node, done = self._roots.get(salt), 0
            if node is None:
                node = self._roots[salt] = _Node(None, -1, None)
        else:
            node, done = resume
        for key, block in zip(keys, blocks):
            child = node.children.get(key)
            if child is None:
                if block in self._node_of_block:  # already cached under another prefix
                    break
                child = _Node(key, block, node)
                node.children[key] = child
                self._node_of_block[block] = child
            elif child.block != block:
                # Same tokens, another physical copy: stop here. Below a node, every block a
                # sequence references keeps its ancestors referenced too, so unreferenced
                # nodes can always be evicted leaf by leaf (num_evictable is exact).
                break
            node = child
            done += 1
        return (node, done) if done else None

    def release(self, block: int) -> None:
        """Called when a cached block loses its last reference: it stays cached, evictable."""
        node = self._node_of_block[block]
        self.evictable.add(block)
        if not node.children:
            self._lru[block] = None

    def release_all(self, blocks: list[int]) -> list[int]:
        """`release` of each cached block among `blocks` (which lost their last references);
        returns the others, which the caller frees."""
        node_of_block, evictable, lru = self._node_of_block, self.evictable, self._lru
        uncached = []
        for block in blocks:
            node = node_of_block.get(block)
            if node is None:
                uncached.append(block)
                continue
            evictable.add(block)
            if not node.children:
                lru[block] = None
        return uncached

    def evict(self) -> int | None:
        """Removes the least recently released unreferenced leaf; returns its block (None if none)."""
        blocks = self.evict_many(1)
        return blocks[0] if blocks else None

    def evict_many(self, count: int) -> list[int]:
        """Removes up to `count` unreferenced leaves, least recently released first (a parent that
        becomes a leaf queues behind them); returns their blocks."""
        evicted: list[int] = []
        lru, node_of_block, evictable = self._lru, self._node_of_block, self.evictable
        while lru and len(evicted) < count:
            block, _ = lru.popitem(last=False)
            if block not in evictable:
                continue  # stale entry: re-referenced, or gone
            node = node_of_block[block]
            if node.children:
                continue  # stale entry: it gained children since (it is queued again when it loses them)
            parent = node.parent
            del parent.children[node.key]
            del node_of_block[block]
            evictable.discard(block)
            evicted.append(block)
            if parent.block >= 0 and not parent.children and parent.block in evictable:
                # Now a leaf: queued behind the blocks released since, so a shared prefix
                # outlives the tails that hung below it.
                lru[parent.block] = None
        self.num_evictions += len(evicted)
        return evicted
