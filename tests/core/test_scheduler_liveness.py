"""Liveness under random load (hypothesis): random add_request / abort / step with random sampling
(n up to 8, beams, temperatures, shared prefixes, salts, max_tokens) on tiny pools, both
preemption modes, both policies, with and without swap space, with and without the prefix cache's
host tier (either eviction policy), with and without speculative decoding (its verify steps
accept drafts at random, so rejected tails are given back at every length). After a bounded number of steps every request has ended
(finished, refused at the door, ended with an error, or aborted), every block is free, and at
every step refcounts equal the references of the block tables and no write lands in
a slot that another holder of the block sees differently: every sequence holding a written block
has the same tokens up to the written position (copy-on-write ran before divergent writes; a
prefix-cache hit or a recomputed beam sharing a block written in the same step reads exactly
what is written, since each layer writes before it attends), and a draft's write lands in a
block only its own sequence holds. The prefix cache only ever holds verified tokens: every cached
block's path in the radix tree spells a prefix of some sequence's tokens."""

import zlib
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import ModelOutput
from jpaged.engine import EngineObserver, LLMEngine

VOCAB = 48
MAX_STEPS = 4000


class RandomTokens:
    """An executor without a model: each sampled token is a hash of (request, sample, position), and
    beams get seeded random candidates, so runs are deterministic and tokens vary (stop tokens hit).
    A verify step's row takes the draft it checks on two hashes out of three (so drafts are
    accepted, then rejected, at every depth)."""

    vocab_size = VOCAB
    num_compilations = 0

    def __init__(self):
        self.clock = 0.0
        self.block_manager = self.scheduler = None  # set once the engine exists

    def execute(self, plan) -> ModelOutput:
        if plan.num_tokens:
            self._check_writes(plan)
        self.clock += 1e-3
        rows = plan.sampling
        if rows is None:
            return ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=1e-3)
        offsets = rows.spec_offsets or [0] * len(rows)
        keys = [f"{s.group.request_id}/{i}/{len(s) + j}" for s, i, j in
                zip(rows.seqs, rows.indices or [s.index for s in rows.seqs], offsets)]
        tokens = [zlib.crc32(k.encode()) % VOCAB for k in keys]
        for r, draft in enumerate(rows.spec_drafts or ()):
            if draft >= 0 and zlib.crc32(keys[r].encode()) % 3:
                tokens[r] = draft
        logprobs = np.full(len(rows), -1.0)
        top_ids = top_logprobs = None
        if rows.num_top:
            rng = np.random.default_rng([zlib.crc32(k.encode()) for k in keys])
            top_ids = np.stack([rng.permutation(VOCAB)[: rows.num_top] for _ in keys])
            top_logprobs = -np.cumsum(rng.exponential(1.0, (len(keys), rows.num_top)), axis=1)
        return ModelOutput(token_ids=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs,
                           duration=1e-3)

    def now(self) -> float:
        return self.clock

    def _check_writes(self, plan) -> None:
        bm = self.block_manager
        bs = bm.block_size
        holders: dict[int, list] = {}  # block -> sequences whose tables hold it
        for group in self.scheduler.running:
            for seq in group.seqs:
                if bm.rows.has_seq(seq.seq_id):
                    for block in bm.rows.table(seq.seq_id).tolist():
                        holders.setdefault(block, []).append(seq)
        slots = plan.slot_mapping[: plan.num_tokens].tolist()
        for s, seq in enumerate(plan.seqs):
            lo, hi = plan.query_start_loc[s], plan.query_start_loc[s + 1]
            for position, slot in zip(plan.positions[lo:hi].tolist(), slots[lo:hi]):
                if position >= len(seq):  # a draft token: not in its sequence yet
                    assert holders[slot // bs] == [seq], f"a draft lands in block {slot // bs}, which others hold"
                    continue
                for other in holders[slot // bs]:
                    assert len(other) > position and other.token_ids[: position + 1] == seq.token_ids[: position + 1], \
                        f"a write at position {position} lands in block {slot // bs}, which another sequence holds"


class InvariantChecker(EngineObserver):
    """After every step: refcounts equal table references; free + referenced + cached = usable."""

    def __init__(self):
        self.streams: dict[int, tuple[int, ...]] = {}  # seq id -> its tokens, as last seen

    def on_step_end(self, engine, out, outputs, end) -> None:
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        refs = Counter()
        for group in scheduler.running:
            for seq in group.seqs:
                if bm.rows.has_seq(seq.seq_id):
                    refs.update(bm.rows.table(seq.seq_id).tolist())
        assert 0 not in refs
        expected = np.zeros(bm.num_blocks, np.int64)
        for block, count in refs.items():
            expected[block] = count
        np.testing.assert_array_equal(bm.refcount, expected)
        cached = bm.prefix_cache.num_evictable if bm.prefix_cache is not None else 0
        assert len(bm._free) + len(refs) + cached == bm.num_usable_blocks
        if bm.prefix_cache is not None and out.plan.sampling is not None and out.plan.sampling.spec_offsets:
            self._check_cache_is_verified(engine, bm.prefix_cache)

    def on_request_finished(self, engine, group, output) -> None:
        for seq in group.seqs:
            self.streams[seq.seq_id] = tuple(seq.token_ids)

    def _check_cache_is_verified(self, engine, cache) -> None:
        """After a verify step: every cached block's path in the radix tree spells a prefix of some
        sequence's tokens (an ended sequence's kept in `streams`): no rejected draft got cached."""
        for group in engine._groups.values():
            for seq in group.seqs:
                self.streams[seq.seq_id] = tuple(seq.token_ids)
        stack = [(node, ()) for node in cache._roots.values()]
        while stack:
            node, spelled = stack.pop()
            for key, child in node.children.items():
                path = spelled + tuple(key)
                assert any(stream[: len(path)] == path for stream in self.streams.values()), \
                    f"cached block {child.block} holds tokens no sequence has: {path}"
                stack.append((child, path))


@st.composite
def sampling_params(draw):
    kind = draw(st.sampled_from(["greedy", "sample", "parallel", "beam"]))
    max_tokens = draw(st.integers(1, 40))
    stop = tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)))
    ignore_eos = draw(st.booleans())
    if kind == "beam":
        return SamplingParams(n=draw(st.integers(1, 8)), use_beam_search=True, max_tokens=max_tokens,
                              stop_token_ids=stop, ignore_eos=ignore_eos)
    return SamplingParams(n=draw(st.integers(2, 8)) if kind == "parallel" else 1,
                          temperature=0.0 if kind == "greedy" else draw(st.floats(0.1, 2.0)),
                          max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos,
                          seed=draw(st.integers(0, 3)))


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_num_seqs = draw(st.integers(1, 12))
    prefix_caching = draw(st.booleans())
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=draw(st.integers(64 // block_size + 2, 200 // block_size)),
                          num_host_blocks=draw(st.sampled_from([0, 8, 200])),
                          watermark=draw(st.sampled_from([0.0, 0.05])),
                          enable_prefix_caching=prefix_caching,
                          num_host_cache_blocks=draw(st.sampled_from([0, 4, 64])) if prefix_caching else 0,
                          eviction_policy=draw(st.sampled_from(["lru", "arc"]))),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=draw(st.integers(max(max_num_seqs, 4), 96)),
                                  max_model_len=64, preemption_mode=draw(st.sampled_from(["swap", "recompute"])),
                                  policy=draw(st.sampled_from(["paper", "chunked"])),
                                  long_prefill_token_threshold=draw(st.sampled_from([0, 5]))),
        speculative=draw(st.sampled_from([SpeculativeConfig()] * 2 + [
            SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=n,
                              disable_by_batch_size=size)
            for k, n, size in ((1, 1, None), (3, 2, None), (5, 3, 4))])),
        executor="sim")
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6]]
    actions = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["add", "add", "add", "step", "abort"]))
        if kind == "add":
            prefix = draw(st.sampled_from([[]] + prefixes))
            tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1 - min(len(prefix), 1), max_size=30))
            actions.append(("add", prefix + tail, draw(sampling_params()), draw(st.sampled_from([None, "x"]))))
        elif kind == "step":
            actions.append(("step", draw(st.integers(1, 20))))
        else:
            actions.append(("abort", draw(st.integers(0, 20))))
    return config, actions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_every_request_ends_and_every_block_comes_back(scenario):
    config, actions = scenario
    executor = RandomTokens()
    engine = LLMEngine(config, executor=executor)
    executor.block_manager = engine.scheduler.block_manager
    executor.scheduler = engine.scheduler
    engine.observers.append(InvariantChecker())
    accepted, finished = [], Counter()

    def step():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] += 1

    for action in actions:
        if action[0] == "add":
            request_id = f"r{len(accepted)}-{len(finished)}"
            try:
                engine.add_request(request_id, action[1], action[2], cache_salt=action[3])
            except ValueError:
                continue  # refused at the door with a clear error: it never entered
            accepted.append(request_id)
        elif action[0] == "step":
            for _ in range(action[1]):
                step()
        elif accepted:
            try:
                engine.abort(accepted[action[1] % len(accepted)])
            except KeyError:
                pass  # finished already (or aborted twice): nothing to stop
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished(), "the engine stalled"
    assert all(finished[r] == 1 for r in accepted), "a request ended twice or never"
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    assert not engine.scheduler.block_manager.refcount.any()
