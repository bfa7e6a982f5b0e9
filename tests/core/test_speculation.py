"""Speculative decoding's host half: prompt lookup, the acceptance rule, the config's readings and
errors, trimming a rejected tail, and a verify step's plan. (Invariants under random load:
tests/core/test_scheduler_liveness.py and test_block_manager_stateful.py; on the real model:
tests/engine/test_engine_speculative.py.)"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from jpaged.config.presets import get_preset
from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.speculation import PLACEHOLDER, NgramIndex, Speculator, accepted_length, ngram_draft
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from jpaged.engine import LLMEngine
from jpaged.paper.sim.executor import SimExecutor
from tests.helpers.kv import allocate


def test_ngram_draft_takes_the_longest_suffix_then_its_first_occurrence():
    tokens = [1, 5, 3, 9, 5, 2, 3, 7, 8, 5, 2, 3]
    # The 3-gram [5, 2, 3] occurs at 4: it proposes what followed it there.
    assert ngram_draft(tokens, 3, 1, 3) == [7, 8, 5]
    # Capped at 1-grams, [3] occurs at 2 and 6: the first proposes [9, 5, 2].
    assert ngram_draft(tokens, 3, 1, 1) == [9, 5, 2]
    assert ngram_draft(tokens, 1, 1, 1) == [9]
    assert ngram_draft([4, 5, 6], 3, 1, 3) == []  # no earlier occurrence of any suffix
    assert ngram_draft([4, 5, 6, 4], 3, 2, 3) == []  # only a 1-gram would match
    assert ngram_draft([7, 7, 7, 7], 4, 1, 3) == [7]  # the match runs into the suffix: fewer than k
    assert ngram_draft([1], 4, 1, 3) == []


def _lookup_by_definition(tokens, k, min_n, max_n):
    """ngram_draft read off its docstring: every n-gram window, longest first, first start."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:] if n <= len(tokens) - 1 else None
        starts = [i for i in range(len(tokens) - n) if suffix is not None and tokens[i: i + n] == suffix]
        if starts:
            return tokens[starts[0] + n: starts[0] + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_ngram_draft_equals_the_lookup_by_definition(tokens, k, min_n, extra):
    # A vocabulary of four makes repeats, long matches and matches running into the suffix common.
    assert ngram_draft(tokens, k, min_n, min_n + extra) == _lookup_by_definition(tokens, k, min_n, min_n + extra)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(1, 6), min_size=1, max_size=12),
       st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_the_incremental_index_drafts_as_ngram_draft_while_the_sequence_grows(tokens, steps, k, min_n, extra):
    # The sequence grows by a few tokens a step (the accepted drafts and the correction).
    index, ends = NgramIndex(min_n, min_n + extra), np.cumsum(steps)
    for end in ends[ends <= len(tokens)].tolist() + [len(tokens)]:
        assert index.draft(tokens[:end], k) == ngram_draft(tokens[:end], k, min_n, min_n + extra)
    with pytest.raises(ValueError, match="token_ids: "):
        index.draft(tokens[:len(tokens) - 1], k) if len(tokens) > 1 else index.draft([], k)


def test_accepted_length_counts_the_leading_drafts_the_samples_confirm():
    assert accepted_length([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_length([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_length([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_length([], [4]) == 0


def test_config_reads_prompt_lookup_bounds_as_vllm_and_names_bad_fields():
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).prompt_lookup_max == 5
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    assert not SpeculativeConfig().enabled
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        SpeculativeConfig(method="ngram")
    with pytest.raises(ValueError, match=r"speculative.num_speculative_tokens: .*\[0, 16\]"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=17)
    with pytest.raises(ValueError, match="speculative.prompt_lookup_min"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative.model: .*required by method 'draft_model'"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative.model: .*got 'draft' with method 'ngram'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, model="draft")


def _sim_engine(speculative: SpeculativeConfig) -> LLMEngine:
    config = EngineConfig(cache=CacheConfig(num_blocks=64, block_size=4), executor="sim",
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                          speculative=speculative)
    return LLMEngine(config, executor=SimExecutor(get_preset("tiny-opt"), block_size=4))


def test_beam_search_is_refused_naming_the_field():
    engine = _sim_engine(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    with pytest.raises(ValueError, match=r"sampling_params.use_beam_search: not supported with speculative"):
        engine.add_request("beam", [1, 2, 3], SamplingParams(n=2, use_beam_search=True))


def test_an_executor_without_a_draft_model_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"speculative.method: 'draft_model' needs an executor .* SimExecutor"):
        _sim_engine(SpeculativeConfig(method="draft_model", model="assets/none", num_speculative_tokens=2))


def test_trim_gives_back_the_blocks_past_the_kept_tokens():
    bm = BlockManager(9, 4, 0, max_model_len=32, watermark=0.0, max_seqs=2)
    row = allocate(bm, 1, 6)  # two blocks, the second half full
    free = bm.num_free_blocks
    slots, copies = bm.append_slots(np.array([row]), np.array([5]))  # 6 -> 11 tokens: a third block
    assert bm.num_free_blocks == free - 1 and not copies and len(slots) == 5
    bm.trim(1, 8)  # the rejected tail held the third block alone
    assert bm.num_free_blocks == free and bm.rows.num_slots(1) == 8
    assert len(bm.rows.table(1)) == 2
    with pytest.raises(ValueError, match="holds 8 slots, cannot keep 9"):
        bm.trim(1, 9)


def _group(request_id: str, tokens: list[int], max_tokens: int = 20, **params) -> Sequence:
    seq = Sequence(int(request_id[1:]), tokens)
    SequenceGroup(request_id, [seq], SamplingParams(max_tokens=max_tokens, **params), 0.0, 0)
    return seq


def test_drafts_respect_room_controls_and_the_batch_size_bound():
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2,
                               disable_by_batch_size=3)
    speculator = Speculator(config, max_num_seqs=16, max_num_batched_tokens=64)
    repeat = [1, 2, 3, 4, 5, 6, 1, 2]
    plain, short, penalised = (_group("r1", repeat), _group("r2", repeat, max_tokens=3),
                               _group("r3", repeat, presence_penalty=0.5))
    short.token_ids += [3]  # 9 of its 8 + 3 tokens: room for one more draft and the step's own token
    assert speculator.drafts([plain, short, penalised][:2]) == [[3, 4, 5, 6], [4]]
    # Penalties read the history: no drafts for that row.
    assert speculator.drafts([plain, penalised]) == [[3, 4, 5, 6], []]
    assert speculator.drafts([plain, short, penalised]) is None  # disable_by_batch_size
    # 8 sampler rows (or tokens) for 2 sequences: at most 3 drafts each.
    assert Speculator(config, max_num_seqs=8, max_num_batched_tokens=64).drafts([plain, plain]) == [[3, 4, 5]] * 2
    assert Speculator(config, max_num_seqs=16, max_num_batched_tokens=8).drafts([plain, plain]) == [[3, 4, 5]] * 2
    assert speculator.verified([3, 4, 5], [3, 4, 9, 1]) == 2
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 2)
    assert stats.accepted_per_pos == [1, 1, 0, 0] and stats.mean_acceptance_length == 3.0


def test_a_draft_model_gets_placeholders_under_the_same_rules():
    config = SpeculativeConfig(method="draft_model", model="assets/none", num_speculative_tokens=4,
                               disable_by_batch_size=3)
    speculator = Speculator(config, max_num_seqs=16, max_num_batched_tokens=64)
    novel = [9, 8, 7, 6, 5]  # nothing for prompt lookup: a draft model drafts anyway
    plain, short, penalised = (_group("r1", novel), _group("r2", novel, max_tokens=3),
                               _group("r3", novel, presence_penalty=0.5))
    short.token_ids += [3, 2]  # 7 of its 5 + 3 tokens: room for the step's own token alone
    assert speculator.drafts([plain, penalised]) == [[PLACEHOLDER] * 4, []]
    assert speculator.drafts([short, penalised]) is None  # nobody drafts
    assert speculator.drafts([plain, short, penalised]) is None  # disable_by_batch_size
    narrow = Speculator(config, max_num_seqs=6, max_num_batched_tokens=64)
    assert narrow.drafts([plain, plain]) == [[PLACEHOLDER] * 2] * 2
