"""The conversation workload on this CPU with the real model: the host tier's hit-rate change, measured.

The stdlib model (assets/stdlib-lm) serves `num_conversations` conversations of `turns` rounds
each, `concurrency` rounds at a time: a conversation's next round joins the back of the queue when
its reply comes back, its prompt the whole history (earlier prompts and the replies the engine
produced, greedy) plus a new query of `query_len` seeded token ids. The device pool
(`cache.num_blocks`) holds a few histories, so on the device alone a conversation's history is
mostly evicted by the rounds of the others before it comes back; a host tier of 1x or 4x the pool
keeps it. Per (tier, policy): the prefix-hit rate (cached / admitted prompt tokens), the tier's
promotions, wall and CPU seconds, and whether every reply is the one the run without a tier gave
(the tier must change no token).

    python -m experiments.conversation.cpu --config configs/conversation_cpu.yaml
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time

import numpy as np

from experiments import common
from experiments.common import REPO_ROOT, provenance, write_json
from jpaged.config import CacheConfig, SchedulerConfig, config_to_dict
from jpaged.core.kv.eviction import POLICIES
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.engine_args import load_engine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConversationCPUConfig:
    """The real model, the conversations, the tiers and policies compared."""

    model: str = "assets/stdlib-lm"  # a local HF directory (relative to the repo root) or a preset
    host_tiers: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0, 4.0])  # x the device pool
    eviction_policies: list[str] = dataclasses.field(default_factory=lambda: ["lru", "arc"])
    num_conversations: int = 12
    turns: int = 4  # rounds per conversation
    query_len: int = 24  # new tokens per round's query
    reply_len: int = 24  # tokens per reply (greedy, EOS ignored)
    concurrency: int = 2  # rounds in flight at once
    seed: int = 0  # seeds the queries
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # device pool; the tier is set per run
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    attention_backend: str = "xla"
    output: str = "results/conversation_cpu.json"

    def __post_init__(self) -> None:
        if not self.host_tiers or any(not 0 <= x < float("inf") for x in self.host_tiers) or 0 not in self.host_tiers:
            raise ValueError(f"host_tiers must be finite multiples >= 0 and hold 0 (the reference), got {self.host_tiers}")
        if not self.eviction_policies or any(p not in POLICIES for p in self.eviction_policies):
            raise ValueError(f"eviction_policies must name some of {', '.join(POLICIES)}, got {self.eviction_policies}")
        for name in ("num_conversations", "turns", "query_len", "reply_len", "concurrency"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def serve(config: ConversationCPUConfig, tier: float, policy: str) -> dict:
    """Serves the conversations with a host tier of `tier` x the device pool; its counters, times and replies."""
    host = round(tier * (config.cache.num_blocks - 1))
    model = str(REPO_ROOT / config.model) if os.path.isdir(REPO_ROOT / config.model) else config.model
    engine, text = load_engine(model, attention_backend=config.attention_backend,
                               **config_to_dict(config.cache) | {"enable_prefix_caching": True,
                                                                 "num_host_cache_blocks": host,
                                                                 "eviction_policy": policy},
                               **config_to_dict(config.scheduler))
    vocab = text.vocab_size if text is not None else engine.vocab_size
    rng = np.random.default_rng(config.seed)
    # [conversations, turns, query_len] the queries, the same for every tier
    queries = rng.integers(4, vocab, (config.num_conversations, config.turns, config.query_len)).tolist()
    params = SamplingParams(max_tokens=config.reply_len, ignore_eos=True, temperature=0.0)
    history: list[list[int]] = [[] for _ in range(config.num_conversations)]
    replies: dict[str, list[int]] = {}
    queue = collections.deque((c, 0) for c in range(config.num_conversations))
    in_flight: dict[str, tuple[int, int, list[int]]] = {}
    wall, cpu = time.perf_counter(), time.process_time()
    while queue or in_flight:
        while queue and len(in_flight) < config.concurrency:
            c, turn = queue.popleft()
            prompt = history[c] + queries[c][turn]
            request_id = f"{c}.{turn}"
            engine.add_request(request_id, prompt, params)
            in_flight[request_id] = (c, turn, prompt)
        for out in engine.step():
            if not out.finished:
                continue
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            c, turn, prompt = in_flight.pop(out.request_id)
            replies[out.request_id] = list(out.output_token_ids[0])
            history[c] = prompt + replies[out.request_id]
            if turn + 1 < config.turns:
                queue.append((c, turn + 1))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stats = engine.kv_stats()
    return {"host_tier": tier, "eviction_policy": policy, "host_cache_blocks": host,
            "prefix_hit_rate": stats["prefix_cache_hit_rate"], "prefix_cached_tokens": stats["prefix_cached_tokens"],
            "prefix_queried_tokens": stats["prefix_queried_tokens"],
            "host_cache_promotions": stats["host_cache_promotions"], "host_cache_offloads": stats["host_cache_offloads"],
            "host_cache_evictions": stats["host_cache_evictions"],
            "prefix_cache_evictions": stats["prefix_cache_evictions"], "wall_s": wall, "cpu_s": cpu,
            "load_avg_1m": os.getloadavg()[0], "replies": replies}


def run(config: ConversationCPUConfig) -> dict:
    """Serves the conversations at every (tier, policy) (tier 0 too: the policy orders the device
    tier's evictions as well, so each policy's replies are compared with its own run without a
    tier); writes and returns the JSON (the replies themselves are left out)."""
    prov = provenance(config, seed=config.seed, device="cpu")
    runs = [serve(config, float(t), p) for t in config.host_tiers for p in config.eviction_policies]
    reference = {p: next(r["replies"] for r in runs if r["host_tier"] == 0 and r["eviction_policy"] == p)
                 for p in config.eviction_policies}
    for r in runs:
        r["replies_as_without_tier"] = r.pop("replies") == reference[r["eviction_policy"]]
    result = {"runs": runs, "settings": config_to_dict(config), "provenance": prov}
    write_json(REPO_ROOT / config.output, result)
    for r in runs:
        print(f"host {r['host_tier']:g}x {r['eviction_policy']}: hit {100 * r['prefix_hit_rate']:5.1f}%  "
              f"promotions {r['host_cache_promotions']:4d}  wall {r['wall_s']:6.1f} s  cpu {r['cpu_s']:6.1f} s  "
              f"load {r['load_avg_1m']:.1f}  same replies as without a tier: {r['replies_as_without_tier']}")
    return result


def main() -> None:
    """The command line: `python -m experiments.conversation.cpu [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ConversationCPUConfig, run, "configs/conversation_cpu.yaml")


if __name__ == "__main__":
    main()
