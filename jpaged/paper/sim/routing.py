"""Routers of a simulated fleet: round-robin, and sglang-router's cache-aware rule.

A router picks the replica of each arriving request from its prompt tokens and the replicas'
loads (requests routed there and not yet finished, the count sglang-router keeps per worker).

`CacheAware` models sglang-router's `cache_aware` policy (sgl-project/sglang,
sgl-router/src/policies/cache_aware.rs and tree.rs; the same rule and defaults in vllm-router and
sgl-model-gateway). The router keeps an approximate radix tree of the prompts it sent to each
replica (it never asks the replicas what they cached), and for each request:
1. If the loads are imbalanced, max - min > `balance_abs_threshold` (64) AND max >
   `balance_rel_threshold` (1.5) x min, the least-loaded replica gets it (shortest queue).
2. Otherwise it walks the tree along the prompt; the match rate is the matched length over the
   prompt's length. Above `cache_threshold` (0.3) the most recently used replica at the deepest
   matched node gets it; at or below, the replica whose tree holds the fewest tokens does.
3. The prompt is inserted into the tree for the chosen replica (in both cases).
Modelled differently: the tree holds token ids in whole blocks of `block_size` tokens rather than
characters (a match is rounded down to a block, at most block_size - 1 tokens short); its LRU
eviction beyond `max_tree_size` (2^26 characters by default) is left out, and the result records
the largest tree so that a run can show it stayed below that size; ties go to the lowest index
(sglang's hash-map order is arbitrary).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from jpaged.core.kv.prefix_cache import block_keys

POLICIES = ("round_robin", "cache_aware")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """The cache-aware rule's knobs; defaults are sglang-router's (launch_router.py's CLI defaults)."""

    cache_threshold: float = 0.3  # match rate above which the request follows its prefix, in [0, 1)
    balance_abs_threshold: int = 64  # imbalanced only if max load - min load exceeds this (requests)
    balance_rel_threshold: float = 1.5  # ... and max load exceeds this times min load (>= 1)
    block_size: int = 16  # tokens per node of the router's tree (our granularity; sglang: characters)

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold < 1.0:
            raise ValueError(f"router.cache_threshold must be in [0, 1), got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"router.balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not 1.0 <= self.balance_rel_threshold < float("inf"):
            raise ValueError(f"router.balance_rel_threshold must be finite and >= 1, got {self.balance_rel_threshold}")
        if self.block_size < 1:
            raise ValueError(f"router.block_size must be >= 1, got {self.block_size}")


class Router(Protocol):
    """Picks a replica for each request; `decisions` counts the rule behind each pick."""

    decisions: Counter

    def route(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The replica index for a request with `prompt` token ids, given every replica's load."""


class RoundRobin:
    """Replicas in turn, whatever the prompt or the loads (sglang-router's `round_robin`)."""

    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self.decisions: Counter = Counter()
        self._next = 0

    def route(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The next replica in turn."""
        replica, self._next = self._next, (self._next + 1) % self.num_replicas
        self.decisions["round_robin"] += 1
        return replica


class _Node:
    __slots__ = ("children", "last_use")

    def __init__(self) -> None:
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_use: dict[int, int] = {}  # replica -> the router's counter at its latest request through here


class ApproxTree:
    """sglang-router's per-router approximate tree: which replica was sent which prompt prefix."""

    def __init__(self, num_replicas: int, block_size: int):
        self.block_size = block_size
        self.root = _Node()
        self.sizes = [0] * num_replicas  # tokens of the tree's nodes each replica appears on
        self._clock = 0  # orders uses, as sglang's millisecond timestamps do

    def match(self, keys: list[tuple[int, ...]]) -> tuple[int, int | None]:
        """(matched tokens, the most recent replica at the deepest matched node; None at the root)
        of a prompt given as its full blocks' token ids (`prefix_cache.block_keys`)."""
        node, depth = self.root, 0
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            node, depth = child, depth + 1
        if node is self.root:
            return 0, None
        return depth * self.block_size, max(node.last_use, key=node.last_use.__getitem__)

    def insert(self, keys: list[tuple[int, ...]], replica: int) -> None:
        """Records that `replica` was sent a prompt, given as its full blocks' token ids."""
        self._clock += 1
        node = self.root
        for key in keys:
            node = node.children.setdefault(key, _Node())
            if replica not in node.last_use:
                self.sizes[replica] += self.block_size
            node.last_use[replica] = self._clock

    def smallest(self) -> int:
        """The replica whose tree holds the fewest tokens (the lowest index among equals)."""
        return min(range(len(self.sizes)), key=self.sizes.__getitem__)


class CacheAware:
    """sglang-router's `cache_aware` policy (the module docstring states the rule)."""

    def __init__(self, num_replicas: int, config: RouterConfig = RouterConfig()):
        self.config = config
        self.tree = ApproxTree(num_replicas, config.block_size)
        self.decisions: Counter = Counter()

    def route(self, prompt: Sequence[int], loads: Sequence[int]) -> int:
        """The least-loaded replica when loads are imbalanced, else the prefix's replica or the
        emptiest tree's (see the module docstring); the prompt joins the chosen replica's tree."""
        c = self.config
        keys = block_keys(list(prompt), c.block_size)
        high, low = max(loads), min(loads)
        if high - low > c.balance_abs_threshold and high > c.balance_rel_threshold * low:
            replica, rule = min(range(len(loads)), key=loads.__getitem__), "load_balance"
        else:
            matched, owner = self.tree.match(keys)
            if owner is not None and matched / max(len(prompt), 1) > c.cache_threshold:
                replica, rule = owner, "prefix_match"
            else:
                replica, rule = self.tree.smallest(), "smallest_tree"
        self.tree.insert(keys, replica)
        self.decisions[rule] += 1
        return replica


def make_router(policy: str, num_replicas: int, config: RouterConfig = RouterConfig()) -> Router:
    """A fresh router of `policy` (round_robin | cache_aware) over `num_replicas` replicas."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    return RoundRobin(num_replicas) if policy == "round_robin" else CacheAware(num_replicas, config)
