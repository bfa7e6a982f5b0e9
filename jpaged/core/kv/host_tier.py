"""The prefix cache's second tier: evicted device blocks kept in host memory, promoted back on a hit.

The host pool is the swap space's (`jpaged.core.kv.swap_space`): one pool of host blocks serves
preempted groups and this tier. The tier holds at most `capacity` of them; its blocks are never
referenced by a sequence, so they are as good as free to the swap space, which takes them back
(`evict`) when a preempted group needs room: the cache never starves a preemption. Swapped-out
blocks are never evicted. Without swap space (cache.num_host_blocks = 0) nothing swaps out: the
pool is the tier's alone, and preempted groups are recomputed.

When the device tier evicts a cached block (`PrefixCache.evict_many`), the tier takes a host
block (a free one within its capacity, else it evicts one of its own leaves by its policy) and
the node moves there; the copy (device, host) is queued for the step being scheduled, which the
executor runs before anything writes the device block again (`StepPlan.offload_pairs`: copies
out come first). A match that reaches host nodes promotes them at admission: they leave the tier
(`detach`), get fresh device blocks, and the copies (host, device) join the step's swap-ins. A
host block a step reads (promotions, swapped groups coming back) is freed only when the next
step is scheduled (`SwapSpace.settle`), so no copy out of the same step overwrites it first.
Pure Python: no numpy or jax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.core.kv.eviction import EvictionPolicy
    from jpaged.core.kv.prefix_cache import Node
    from jpaged.core.kv.swap_space import SwapSpace


class HostTier:
    """Cached blocks in host memory: which node holds which host block, the copies to run, counters."""

    def __init__(self, pool: SwapSpace, capacity: int, policy: EvictionPolicy):
        if capacity < 1:
            raise ValueError(f"num_host_cache_blocks must be >= 1 for a host tier, got {capacity}")
        self.pool = pool  # the host pool shared with swap preemption
        self.capacity = capacity  # the most host blocks the tier holds
        self.policy = policy  # the host tier's eviction order (its candidates: leaves)
        self._node_of: dict[int, Node] = {}  # host block -> its node
        self.offloads: list[tuple[int, int]] = []  # (device, host) copies for the step being scheduled
        self.promotions: list[tuple[int, int]] = []  # (host, device) copies for the step being scheduled
        self.num_offloads = 0  # blocks copied into the tier
        self.num_promotions = 0  # blocks copied back to the device by prefix hits
        self.num_evictions = 0  # blocks dropped from the tier (for room, or for the swap space)

    @property
    def num_blocks(self) -> int:
        """Host blocks the tier holds."""
        return len(self._node_of)

    def offload(self, node: Node, device_block: int) -> bool:
        """Moves `node`, evicted from the device, into the tier, queueing the copy; False (nothing
        changed) when no host block can be had (the pool is all swapped-out blocks)."""
        nodes = self._node_of
        if len(nodes) < self.capacity and self.pool.num_unused_blocks:
            host = self.pool.take_unused()
        else:
            evicted = self.evict(1)
            if not evicted:
                return False
            host = evicted[0]
        node.block = host
        node.on_host = True
        nodes[host] = node
        self.offloads.append((device_block, host))
        self.num_offloads += 1
        self.policy.entered(node.digest)
        if not node.children:
            self.policy.add(host, node.reused)
        return True

    def evict(self, count: int) -> list[int]:
        """Drops up to `count` leaves of the tier in its policy's order (a parent that becomes a
        leaf joins behind them); returns their host blocks, which the caller now owns."""
        nodes, policy = self._node_of, self.policy
        evicted: list[int] = []
        while len(evicted) < count:
            host = policy.victim()
            if host is None:
                break
            node = nodes.get(host)
            if node is None or node.children:
                continue  # stale entry: promoted or dropped, or it gained children since
            del nodes[host]
            parent = node.parent
            del parent.children[node.key]
            policy.left(node.digest, node.reused)
            evicted.append(host)
            if parent.on_host and not parent.children:
                policy.add(parent.block, parent.reused)
        self.num_evictions += len(evicted)
        return evicted

    def drop_subtree(self, root: Node) -> None:
        """Drops the host nodes below `root` (which left the tree), their blocks back to the pool."""
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            stack += node.children.values()
            del self._node_of[node.block]
            self.policy.discard(node.block)
            self.policy.left(node.digest, node.reused)
            self.pool.release_later(node.block)
            self.num_evictions += 1
        root.children.clear()

    def detach(self, blocks: list[int]) -> list[Node]:
        """Takes the nodes of `blocks` (a matched path's host part, in order) out of the tier before
        their promotion: nothing evicts them while device blocks are found for them; their host
        blocks stay unused until the next step (the step reads them)."""
        nodes = [self._node_of.pop(host) for host in blocks]
        for node in nodes:
            self.policy.discard(node.block)
            self.pool.release_later(node.block)
            node.on_host = False
            node.block = -1
        return nodes

    def promoted(self, blocks: list[int], device_blocks: list[int]) -> None:
        """Queues the copies of a promotion: host `blocks[i]` into `device_blocks[i]`."""
        self.promotions += zip(blocks, device_blocks)
        self.num_promotions += len(blocks)

    def settle(self) -> None:
        """Frees the host blocks the last step read or wrote (`SwapSpace.settle`)."""
        self.pool.settle()

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (device, host) offloads and (host, device) promotions queued since the last call. A
        host block offloaded into twice (evicted from the tier and reused in the same step) keeps
        its last copy only: the first one's content left the tier."""
        offloads, promotions = self.offloads, self.promotions
        self.offloads, self.promotions = [], []
        if len({host for _, host in offloads}) < len(offloads):
            offloads = list({host: (device, host) for device, host in offloads}.values())
        return offloads, promotions
