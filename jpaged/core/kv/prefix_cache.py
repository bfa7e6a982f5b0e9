"""A radix tree over full KV blocks: requests that start with the same tokens share those blocks.

A path from a root is a prefix of whole blocks; each node holds the physical block storing that
block of tokens. There is one root per cache salt, so requests with different salts never share
(tenants cannot probe each other's prompts through timing). The block manager owns reference
counts and tells the cache when a cached block loses its last reference (`release_all`) or gains
one again (`touch`): a node whose block has references is locked; a node without references
keeps its block cached (off the free list, in `evictable`) until space is needed, then it is
evicted in the order of the device tier's `EvictionPolicy` (`jpaged.core.kv.eviction`).

Two tiers. A node lives on the device or, with a host tier (`jpaged.core.kv.host_tier`), in host
memory: an evicted device block is copied to a host block instead of being dropped, and a match
that reaches host nodes returns them for promotion (copied back into fresh device blocks at
admission). Device nodes are the top of the tree (a device node's parent is on the device), so a
match is device blocks, then host blocks. A device node can go once no device node hangs below
it; a host node once it is a leaf.

Pinned prefixes (paper §4.4, "pre-stored" shared prefixes): their full blocks hold a reference
of the pin, so they never go; a pinned prefix that ends inside a block keeps that partial block
beside the node of its last full block (`tails`), and a prompt that continues the prefix past it
maps the partial block too, shared copy-on-write (the first token written into it copies it).
Pure Python: no numpy or jax.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import TYPE_CHECKING, Hashable, Iterable, Protocol

if TYPE_CHECKING:
    from jpaged.core.kv.eviction import EvictionPolicy


def block_keys(token_ids: list[int], block_size: int, known: list[tuple[int, ...]] | None = None
               ) -> list[tuple[int, ...]]:
    """Tuples of the token ids of each full block; extends `known` (keys of a prefix) in place if given."""
    keys = [] if known is None else known
    for i in range(len(keys), len(token_ids) // block_size):
        keys.append(tuple(token_ids[i * block_size: (i + 1) * block_size]))
    return keys


class Node:
    """One cached block of tokens: where it is, what hangs below it (the tree's and the host tier's)."""

    __slots__ = ("key", "block", "parent", "children", "device_children", "on_host", "reused", "digest", "tails")

    def __init__(self, key: tuple[int, ...] | None, block: int, parent: Node | None, digest: int = 0):
        self.key = key  # the block's token ids (None at a root)
        self.block = block  # physical block id on the device, or in the host pool when on_host (-1 at a root)
        self.parent = parent
        self.children: dict[tuple[int, ...], Node] = {}
        self.device_children = 0  # children on the device (the others are in the host tier)
        self.on_host = False  # in the host tier
        self.reused = False  # a prefix hit used it since it was cached (eviction policies may weigh it)
        self.digest = digest  # identity of the path's content (ARC's ghosts); 0 when no policy asks
        self.tails: dict[tuple[int, ...], int] | None = None  # pinned partial blocks below: their tokens -> block


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixHit:
    """What a prompt finds cached: device blocks, then host-tier blocks, covering `num_tokens` tokens."""

    blocks: list[int]  # device blocks of the prompt's first tokens, in logical order
    host_blocks: list[int] = dataclasses.field(default_factory=list)  # host-tier blocks after them (promoted at admission)
    num_tokens: int = 0  # tokens covered: blocks x block size, less a partial last block's room
    partial: bool = False  # the last of `blocks` is a pinned prefix's partial block (shared copy-on-write)

    @property
    def num_blocks(self) -> int:
        """Blocks of the sequence's table the hit fills."""
        return len(self.blocks) + len(self.host_blocks)


NO_HIT = PrefixHit([])


class HostStore(Protocol):
    """The prefix cache's host tier as the tree, the block manager and the scheduler use it
    (`jpaged.core.kv.host_tier.HostTier`)."""

    policy: EvictionPolicy  # the host tier's eviction order

    def offload(self, node: Node, device_block: int) -> bool:
        """Moves a node evicted from the device into the tier (False: no room, nothing changed)."""

    def drop_subtree(self, root: Node) -> None:
        """Drops the host nodes below a node that left the tree."""

    def detach(self, blocks: list[int]) -> list[Node]:
        """Takes the nodes of matched host blocks out of the tier, for their promotion."""

    def promoted(self, blocks: list[int], device_blocks: list[int]) -> None:
        """Queues the copies of a promotion."""

    def settle(self) -> None:
        """Frees the host blocks the last step read or wrote (a step starts being scheduled)."""

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (device, host) offloads and (host, device) promotions of the step being scheduled."""


def root_digest(salt: Hashable) -> int:
    """The content digest of a salt's root: stable across processes (str hashes are not)."""
    return zlib.crc32(repr(salt).encode())


class PrefixCache:
    """Radix tree of full blocks in one or two tiers; it evicts only blocks no live sequence
    references, and never hands out a block twice."""

    def __init__(self, block_size: int, policy: EvictionPolicy, host: HostStore | None = None):
        self.block_size = block_size
        self.policy = policy  # the device tier's eviction order
        self.host = host  # the host tier (None: evicted blocks are dropped)
        self._digests = policy.tracks_content or (host is not None and host.policy.tracks_content)
        self._roots: dict[Hashable, Node] = {}
        self._node_of_block: dict[int, Node] = {}  # device block -> its node
        # Cached device blocks without references (leaves or not): read-only outside the cache (the
        # block manager counts them as free).
        self.evictable: set[int] = set()
        self.num_evictions = 0  # device blocks evicted (dropped, or moved to the host tier)

    # ------------------------------------------------------------------ queries

    def __contains__(self, block: int) -> bool:
        return block in self._node_of_block

    @property
    def num_cached_blocks(self) -> int:
        """Device blocks held by the tree (referenced or not)."""
        return len(self._node_of_block)

    @property
    def num_evictable(self) -> int:
        """Cached device blocks that no sequence references: reclaimable on demand."""
        return len(self.evictable)

    def node(self, block: int) -> Node | None:
        """The node of a cached device block (None if it is not in the tree)."""
        return self._node_of_block.get(block)

    def match(self, keys: list[tuple[int, ...]], salt: Hashable, max_blocks: int,
              token_ids: list[int] | None = None) -> PrefixHit:
        """The longest cached prefix of whole blocks (at most `max_blocks`), device blocks first.

        `keys[i]` is the tuple of token ids of full block i (see `block_keys`). With `token_ids`
        (the prompt), a pinned prefix's partial block continues the match when the prompt goes on
        past it (one token at least is left to compute).
        """
        node = self._roots.get(salt)
        if node is None:
            return NO_HIT
        blocks: list[int] = []
        host_blocks: list[int] = []
        for key in keys[:max_blocks]:
            child = node.children.get(key)
            if child is None:
                break
            node = child
            (host_blocks if child.on_host else blocks).append(child.block)
        bs = self.block_size
        if node.tails and token_ids is not None and not host_blocks:
            start = len(blocks) * bs
            best = max((t for t in node.tails if start + len(t) < len(token_ids)
                        and tuple(token_ids[start: start + len(t)]) == t), key=len, default=None)
            if best is not None:
                return PrefixHit(blocks + [node.tails[best]], [], start + len(best), True)
        if not blocks and not host_blocks:
            return NO_HIT
        return PrefixHit(blocks, host_blocks, (len(blocks) + len(host_blocks)) * bs)

    def path(self, keys: list[tuple[int, ...]], salt: Hashable) -> list[Node]:
        """The nodes of `keys` from the salt's root, as far as the tree holds them."""
        nodes, node = [], self._roots.get(salt)
        for key in keys:
            node = node.children.get(key) if node is not None else None
            if node is None:
                break
            nodes.append(node)
        return nodes

    # ------------------------------------------------------------------ updates

    def touch(self, blocks: list[int]) -> None:
        """Marks the device blocks of a matched prefix as referenced again (not evictable) and reused."""
        node_of_block = self._node_of_block
        for block in blocks:
            node = node_of_block.get(block)
            if node is not None:  # (a pinned partial block is no node)
                self.evictable.discard(block)
                self.policy.discard(block)
                node.reused = True

    def _root(self, salt: Hashable) -> Node:
        """The root of `salt`'s tree, made on first use."""
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = Node(None, -1, None, root_digest(salt) if self._digests else 0)
        return node

    def _add_child(self, node: Node, key: tuple[int, ...], block: int) -> Node:
        """A new device node under `node` for `block`, holding the tokens `key`."""
        child = Node(key, block, node, hash((node.digest, key)) if self._digests else 0)
        node.children[key] = child
        node.device_children += 1
        self._node_of_block[block] = child
        if self._digests:
            self.policy.entered(child.digest)
        return child

    def insert(self, keys: list[tuple[int, ...]], blocks: Iterable[int], salt: Hashable,
               resume: tuple[Node, int] | None = None) -> tuple[Node, int] | None:
        """Adds the full blocks of a sequence (`blocks[i]` holds the tokens `keys[i]`).

        Where the tree already caches the same tokens in another physical block (on the device or
        in the host tier), insertion stops: the tree keeps its first copy, and the sequence's own
        blocks are freed normally.

        `resume` is what an earlier insert of the same (still resident) sequence returned: its
        first blocks are already in the tree as its own, referenced and so never evicted, and
        `keys` and `blocks` continue the path below them. Returns the same for the next insert
        (the sequence's deepest own node and how many of its blocks are in the tree), or None if
        none is.
        """
        if resume is None:
            node, done = self._root(salt), 0
        else:
            node, done = resume
        for key, block in zip(keys, blocks):
            child = node.children.get(key)
            if child is None:
                if block in self._node_of_block:  # already cached under another prefix
                    break
                child = self._add_child(node, key, block)
            elif child.block != block or child.on_host:
                # Same tokens, another physical copy: stop here. Below a node, every block a
                # sequence references keeps its ancestors referenced too, so unreferenced
                # nodes can always be evicted from the bottom up (num_evictable is exact).
                break
            node = child
            done += 1
        return (node, done) if done else None

    def adopt(self, keys: list[tuple[int, ...]], salt: Hashable, blocks: list[int]) -> list[int]:
        """The device blocks of the path `keys` (a prefix being pinned), the tree's own copies
        where it has them on the device; elsewhere `blocks[i]` (a resident sequence's block
        holding the tokens `keys[i]`, not in the tree) becomes the node's block: a new node, or a
        host node brought back without a copy (its host block is freed)."""
        node = self._root(salt)
        path = []
        for key, block in zip(keys, blocks):
            child = node.children.get(key)
            if child is None or child.on_host:
                if block in self._node_of_block:
                    raise ValueError(f"adopt: block {block} is cached already under another prefix")
                if child is None:
                    child = self._add_child(node, key, block)
                else:  # (device nodes sit above host nodes: its parent is on the device)
                    self.promote(self.host.detach([child.block]), [block])
            path.append(child.block)
            node = child
        return path

    def pin_tail(self, keys: list[tuple[int, ...]], salt: Hashable, tokens: tuple[int, ...], block: int) -> None:
        """Keeps `block`, holding `tokens` (fewer than a block) after the full blocks `keys` of a
        pinned prefix, for prompts that continue past it (the caller holds its reference)."""
        nodes = self.path(keys, salt)
        node = nodes[-1] if nodes else self._root(salt)
        if len(nodes) != len(keys) or any(n.on_host for n in nodes):
            raise ValueError("pin_tail: the pinned prefix's full blocks must be cached on the device")
        if node.tails is None:
            node.tails = {}
        node.tails[tokens] = block

    def release_all(self, blocks: list[int]) -> list[int]:
        """Marks each cached device block among `blocks` (which lost their last references)
        evictable; returns the others, which the caller frees."""
        node_of_block, evictable, policy = self._node_of_block, self.evictable, self.policy
        uncached = []
        for block in blocks:
            node = node_of_block.get(block)
            if node is None:
                uncached.append(block)
                continue
            evictable.add(block)
            if not node.device_children:
                policy.add(block, node.reused)
        return uncached

    def evict(self) -> int | None:
        """Evicts the device tier's next candidate; returns its block (None if none)."""
        blocks = self.evict_many(1)
        return blocks[0] if blocks else None

    def evict_many(self, count: int) -> list[int]:
        """Evicts up to `count` unreferenced device blocks with no device block below them, in the
        policy's order (a parent that becomes a candidate joins the policy behind them); each goes
        to the host tier when it has room, else it is dropped. Returns the freed device blocks."""
        evicted: list[int] = []
        node_of_block, evictable, policy, host = self._node_of_block, self.evictable, self.policy, self.host
        while len(evicted) < count:
            block = policy.victim()
            if block is None:
                break
            if block not in evictable:
                continue  # stale entry: re-referenced, or gone
            node = node_of_block[block]
            if node.device_children:
                continue  # stale entry: it gained children since (it is queued again when it loses them)
            parent = node.parent
            del node_of_block[block]
            evictable.discard(block)
            evicted.append(block)
            policy.left(node.digest, node.reused)
            parent.device_children -= 1
            if host is None or not host.offload(node, block):
                del parent.children[node.key]
                if node.children:  # (host nodes below: unreachable without it)
                    host.drop_subtree(node)
            if parent.block >= 0 and not parent.device_children and parent.block in evictable:
                # Now a candidate: queued behind the blocks released since, so a shared prefix
                # outlives the tails that hung below it.
                policy.add(parent.block, parent.reused)
        self.num_evictions += len(evicted)
        return evicted

    def promote(self, nodes: list[Node], blocks: list[int]) -> None:
        """Makes `nodes`, detached from the host tier (`HostTier.detach`, a matched path in order),
        device nodes holding `blocks`, referenced by the sequence that matched them."""
        node_of_block = self._node_of_block
        for node, block in zip(nodes, blocks):
            node.block = block
            node.parent.device_children += 1
            node.reused = True
            node_of_block[block] = node
            if self._digests:
                self.policy.entered(node.digest)
