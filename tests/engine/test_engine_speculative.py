"""Speculative decoding on the real model: the same tokens as without it, greedy and seeded
sampling alike (with n > 1, logprobs, stop ids and max_tokens), in the overlapped loop, through
preemption by recompute and by swap, and with the prefix cache (whose blocks then give the same
outputs again), with n-gram drafts and a draft model's; every block comes back. The drafts must be
accepted and rejected for these to mean anything: each test
checks both happened."""

import jax
import numpy as np
import pytest

from jpaged.config import SpeculativeConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.models import decoder
from pallas_kernels import native_cpu, native_dense_cpu
from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir
from tests.helpers.tiny_engines import make_engine, run_to_end

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
# Prompts that repeat themselves, so that prompt lookup has something to propose.
PROMPTS = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 5 + [14], [3, 4] * 9, list(range(20, 44))]


def _params(i: int) -> SamplingParams:
    """Greedy, seeded sampling with logprobs, two seeded samples, greedy with a stop id."""
    return [SamplingParams(max_tokens=24, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=1.0, seed=3, logprobs=2, ignore_eos=True),
            SamplingParams(n=2, max_tokens=18, temperature=0.8, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=24, stop_token_ids=(7,), ignore_eos=True)][i % 4]


def _serve(engine, prompts=PROMPTS, tag=""):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt, _params(i))
    outputs = run_to_end(engine, max_steps=600)
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]
    return [outputs[f"{tag}{i}"] for i in range(len(prompts))]


def _same(spec_outputs, plain_outputs):
    for spec, plain in zip(spec_outputs, plain_outputs):
        assert [c.token_ids for c in spec.outputs] == [c.token_ids for c in plain.outputs]
        assert [c.finish_reason for c in spec.outputs] == [c.finish_reason for c in plain.outputs]
        for a, b in zip(spec.outputs, plain.outputs):
            if b.logprobs is not None:
                assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
                np.testing.assert_allclose([v for e in a.logprobs for v in e.values()],
                                           [v for e in b.logprobs for v in e.values()], rtol=1e-4, atol=1e-4)


def _accepted_and_rejected(engine):
    stats = engine.kv_stats()
    assert stats["spec_num_accepted_tokens"] > 0, "no draft was accepted: the test checks nothing"
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "no draft was rejected"


def _extended(outputs):
    """PROMPTS extended by the first 12 tokens of their first outputs."""
    return [p + o.outputs[0].token_ids[:12] for p, o in zip(PROMPTS, outputs)]


@pytest.fixture(scope="module")
def plain_outputs():
    """The outputs without speculation: of PROMPTS, then of `_extended` PROMPTS. (make_engine's
    defaults, here and below: the programs other engine tests compile.)"""
    engine = make_engine()
    first = _serve(engine)
    return first, _serve(engine, _extended(first), tag="b")


def test_outputs_equal_those_without_speculation(plain_outputs):
    engine = make_engine(speculative=NGRAM)
    _same(_serve(engine), plain_outputs[0])
    _accepted_and_rejected(engine)
    assert engine.kv_stats()["spec_mean_acceptance_length"] > 1.0


@pytest.mark.skipif(not (native_cpu.available() and native_dense_cpu.available()),
                    reason=f"native CPU kernels: {native_dense_cpu.unavailable_reason()}")
def test_the_native_cpu_path_verifies_every_drafted_position(plain_outputs):
    """With the native CPU kernels (the CPU default: `auto`), whose dense layers compute only the
    rows in use: the same outputs as XLA's path without speculation (decode and prefill steps use
    their rows), and with it (a verify step's k + 1 logits rows per sequence are all in use)."""
    plain = make_engine(attention_backend="cpu_native")
    assert plain.executor.runner.native_dense
    _same(_serve(plain), plain_outputs[0])
    spec = make_engine(attention_backend="cpu_native", speculative=NGRAM)
    _same(_serve(spec), plain_outputs[0])
    _accepted_and_rejected(spec)


def test_the_overlapped_loop_verifies_in_step_and_gives_the_same_tokens(plain_outputs):
    # Steps with drafts are not scheduled ahead (their inputs are the accepted tokens); at
    # disable_by_batch_size sequences the decode steps overlap. (No n > 1 request here: its group
    # keeps the decode fast path, which the loop schedules ahead, off.)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                             disable_by_batch_size=3)
    engine = make_engine(speculative=spec, async_scheduling=True)
    for i in (0, 1, 3):
        engine.add_request(str(i), PROMPTS[i], _params(i))
    outputs = run_to_end(engine, max_steps=600)
    _same([outputs[str(i)] for i in (0, 1, 3)], [plain_outputs[0][i] for i in (0, 1, 3)])
    assert engine.kv_stats()["spec_num_accepted_tokens"] > 0 and engine.num_steps_ahead > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_in_the_middle_of_speculation_loses_nothing(plain_outputs, mode):
    # 12 blocks of 8 slots for 5 sequences of up to 44 tokens: groups are preempted and resumed.
    engine = make_engine(num_blocks=13, preemption_mode=mode, speculative=NGRAM)
    _same(_serve(engine), plain_outputs[0])
    assert engine.kv_stats()["num_preemptions"] > 0
    _accepted_and_rejected(engine)


def test_prefix_cache_blocks_written_by_verify_steps_serve_again(plain_outputs):
    engine = make_engine(prefix_caching=True, speculative=NGRAM)
    first = _serve(engine)
    _same(first, plain_outputs[0])
    # The prompts extended by their outputs: the blocks verify steps wrote hit, and read right.
    _same(_serve(engine, _extended(first), tag="b"), plain_outputs[1])
    assert engine.kv_stats()["prefix_cached_tokens"] > sum(map(len, PROMPTS))
    _accepted_and_rejected(engine)


def _draft_dir(directory, noise: float):
    """tiny-opt's dummy weights (make_engine's target) as a Hugging Face directory, each weight
    plus Gaussian noise of `noise` times its standard deviation (0: the target itself)."""
    spec = get_preset("tiny-opt")
    params = decoder.init_params(spec, seed=0)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    leaves = [np.asarray(x) + noise * np.std(x) * rng.standard_normal(x.shape).astype(np.float32) for x in leaves]
    write_hf_dir(directory, spec, jax.tree.unflatten(tree, leaves), HF_CONFIGS["tiny-opt"])
    return str(directory)


def _draft_model(directory: str, **fields) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=directory, num_speculative_tokens=3, **fields)


def test_the_target_as_its_own_draft_is_accepted_and_changes_nothing(plain_outputs, tmp_path):
    # Speculation off at 2 sequences and more: the draft skips those steps and catches up after.
    engine = make_engine(speculative=_draft_model(_draft_dir(tmp_path / "self", 0.0), disable_by_batch_size=2))
    _same(_serve(engine), plain_outputs[0])
    before = engine.kv_stats()
    plans = []
    launch = engine.executor.launch
    engine.executor.launch = lambda plan: plans.append(plan) or launch(plan)
    # Two greedy requests run side by side (no drafts, no draft runs) until the short one ends;
    # then the long one's missing draft K/V is computed, and it drafts alone. A draft that is the
    # target's own model is accepted whole only if that K/V is right: k + 1 tokens a step.
    engine.add_request("g0", PROMPTS[0], _params(0))
    engine.add_request("g1", PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = run_to_end(engine)
    expected = plain_outputs[0][0].outputs[0].token_ids
    assert [outputs[g].outputs[0].token_ids for g in ("g0", "g1")] == [expected, expected[:5]]
    assert sum(not p.draft_mirror for p in plans) >= 5 and sum(p.draft_catchup is not None for p in plans) == 1
    # The draft is the target: its pool holds the target's K/V at every computed token of g0,
    # those the catch-up computed included. (K/V pools: [layers, KV heads, blocks, block size, D].)
    last = plans[-1]  # (g0's last verify step, alone)
    assert [s.group.request_id for s in last.seqs] == ["g0"]
    table = last.block_tables[0]
    positions = np.arange(len(PROMPTS[0]) + len(expected) - 1)
    blocks, offsets = table[positions // engine.config.cache.block_size], positions % engine.config.cache.block_size
    for target, draft in zip(engine.executor.kv_pool, engine.executor.draft_pool):
        np.testing.assert_allclose(np.asarray(draft)[:, :, blocks, offsets], np.asarray(target)[:, :, blocks, offsets],
                                   rtol=1e-4, atol=1e-5)
    after = engine.kv_stats()
    drafted, accepted = (after[key] - before[key] for key in ("spec_num_draft_tokens", "spec_num_accepted_tokens"))
    num_drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    assert accepted == drafted > 0 and 1 + accepted / num_drafts > 3.5
    assert after["num_free_blocks"] == after["num_total_blocks"]


def test_another_draft_is_verified_through_swap_preemption(plain_outputs, tmp_path):
    # The draft's pool is swapped with the target's. (A draft model drafts for every sequence: 14
    # blocks leave room for verify steps.)
    engine = make_engine(num_blocks=15, preemption_mode="swap",
                         speculative=_draft_model(_draft_dir(tmp_path / "noisy", 1.0)))
    _same(_serve(engine), plain_outputs[0])
    assert engine.kv_stats()["num_preemptions"] > 0
    _accepted_and_rejected(engine)
