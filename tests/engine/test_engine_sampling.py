"""Parallel sampling shares prompt blocks; seeds fix draws; beam search equals a dense beam search."""

import numpy as np
import pytest

from jpaged.core.sequence import SamplingParams
from tests.helpers.tiny_engines import dense_beam_search, make_engine


def test_parallel_sampling_shares_prompt_blocks_and_is_seeded():
    engine = make_engine(block_size=8)
    prompt = list(range(1, 21))  # 20 tokens: 2 full blocks + a partly filled third
    engine.add_request("a", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=1))
    engine.step()  # prefill: one copy of the prompt, then 4 forks share it
    bm = engine.scheduler.block_manager
    group = engine._groups["a"]
    tables = [bm.rows.table(s.seq_id).tolist() for s in group.seqs]
    assert len(group.seqs) == 4 and all(t == tables[0] for t in tables)
    assert bm.num_usable_blocks - bm.num_free_blocks == 3  # not 12
    assert all(bm.refcount[b] == 4 for b in tables[0])
    engine.step()  # first decode: copy-on-write of the shared, partly filled last block
    assert bm.num_usable_blocks - bm.num_free_blocks == 3 + 3
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
    samples = outs["a"].output_token_ids
    assert len(samples) == 4 and len({tuple(s) for s in samples}) > 1

    def run(seed):
        fresh = make_engine(block_size=8)
        fresh.add_request("a", prompt, SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=seed))
        return [o for _ in range(20) for o in fresh.step()][0].output_token_ids

    assert run(1) == samples
    assert run(2) != samples


# Slow: the same guarantee over more settings runs by default in
# tests/engine/test_engine_liveness.py::test_seeded_outputs_do_not_depend_on_batching.
@pytest.mark.slow
def test_sampling_independent_of_batch_and_preemption():
    prompts = [list(range(1, 30)), list(range(5, 40)), list(range(2, 9))]
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, max_tokens=20, seed=3)
    alone = make_engine().generate(prompts[:1], params, use_tqdm=False)[0].output_token_ids
    squeezed = make_engine(num_blocks=13, preemption_mode="recompute")
    batched = squeezed.generate(prompts, params, use_tqdm=False)
    assert squeezed.kv_stats()["num_preemptions"] > 0
    # generate() names requests gen-0-<i> on a fresh engine: request 0 has the same id in both runs.
    assert batched[0].output_token_ids == alone


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_matches_dense_reference(width):
    prompt = [7, 99, 3, 42, 11, 250, 18, 64, 5]
    engine = make_engine(block_size=8)
    out = engine.generate([prompt], SamplingParams(n=width, use_beam_search=True, max_tokens=10,
                                                   length_penalty=0.0), use_tqdm=False)[0]
    expected = dense_beam_search("tiny-opt", prompt, width, 10)
    assert out.output_token_ids == [seq for seq, _ in expected]
    np.testing.assert_allclose([c.cumulative_logprob for c in out.outputs], [score for _, score in expected], rtol=1e-4)
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_beam_search_shares_blocks_along_the_tree():
    engine = make_engine(block_size=8)
    engine.add_request("b", list(range(1, 25)), SamplingParams(n=4, use_beam_search=True, max_tokens=8))
    engine.step()
    bm = engine.scheduler.block_manager
    group = engine._groups["b"]
    assert len(group.live_seqs()) == 4
    # 24 prompt tokens fill 3 blocks exactly; the 4 beams share them (plus nothing else yet).
    assert bm.num_usable_blocks - bm.num_free_blocks == 3


def test_beam_search_without_a_model_branches_and_frees():
    """With the simulator's model-less executor, beams still fork, share blocks and finish."""
    from experiments.bench.bench_host import NullExecutor
    from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
    from jpaged.engine import LLMEngine

    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_model_len=128), executor="sim")
    engine = LLMEngine(config, executor=NullExecutor())
    out = engine.generate([list(range(1, 20))], SamplingParams(n=4, use_beam_search=True, max_tokens=12),
                          use_tqdm=False)[0]
    assert len(out.output_token_ids) == 4 and all(len(t) == 12 for t in out.output_token_ids)
    again = LLMEngine(config, executor=NullExecutor()).generate(
        [list(range(1, 20))], SamplingParams(n=4, use_beam_search=True, max_tokens=12), use_tqdm=False)[0]
    assert [c.cumulative_logprob for c in again.outputs] == [c.cumulative_logprob for c in out.outputs]
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]


@pytest.mark.parametrize("policy", ["paper", "chunked"])
def test_beam_search_without_a_model_does_not_depend_on_its_neighbours(policy):
    """The simulator's beam candidates depend on each beam's rank among its group's rows: finishes
    of other requests around a beam group (rows leaving the running batch) must not reorder them,
    so the group's beams are the same served alone or among short requests."""
    from experiments.bench.bench_host import NullExecutor
    from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
    from jpaged.engine import LLMEngine

    def served(neighbours: int):
        config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=256, num_host_blocks=0),
                              scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=128, policy=policy),
                              executor="sim")
        engine = LLMEngine(config, executor=NullExecutor())
        # The neighbours arrive first: their rows lead the batch, and each finish moves a row
        # from its end (a beam's) into the hole.
        for i in range(neighbours):
            engine.add_request(f"n{i}", list(range(30 + i, 40 + i)),
                               SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True))
        engine.add_request("beams", list(range(1, 20)), SamplingParams(n=4, use_beam_search=True, max_tokens=40))
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == "beams" and out.finished:
                    beams = [(c.token_ids, c.cumulative_logprob) for c in out.outputs]
        return beams

    assert served(12) == served(0)
