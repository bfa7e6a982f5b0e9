"""Smoke runs of the Fig. 14-19 experiments on tiny configs, and memory saving on a hand-built case."""

import dataclasses
import json

import numpy as np
import pytest

from experiments import block_size, chatbot, parallel_sampling, preemption, shared_prefix
from experiments.serving import sharing_counts
from jpaged.config import ModelConfig
from jpaged.core.kv.block_manager import BlockManager
from jpaged.paper.workloads import conversation_lengths
from tests.helpers.kv import allocate


def test_sharing_counts_by_hand():
    bm = BlockManager(20, 4, 0, max_model_len=64)
    allocate(bm, 0, 10)  # 3 blocks, the last one half full
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert sharing_counts(bm, [0, 1, 2]) == (3, 9)  # saving 1 - 3/9
    bm.append_slots(bm.rows.rows_of([1, 2]))  # both copy the shared last block
    assert sharing_counts(bm, [0, 1, 2]) == (5, 9)
    assert sharing_counts(bm, [0]) == (3, 3) and sharing_counts(bm, []) == (0, 0)


def test_conversation_rounds_grow_and_are_cut():
    prompts, outputs = conversation_lengths(2000, np.random.default_rng(0), max_prompt_len=1024)
    assert prompts.max() == 1024 and outputs.max() <= 1024 and min(prompts.min(), outputs.min()) >= 4
    assert (prompts == 1024).mean() > 0.2  # long histories reach the cut


def _beam_trace(path, width=2, traces=2, steps=6, seed=0):
    """A BeamReplay file of random descending candidates (a stand-in for a recorded model)."""
    rng = np.random.default_rng(seed)
    logprobs = -np.cumsum(rng.exponential(0.5, (traces, steps, width, 2 * width)), axis=-1)
    np.savez(path, **{f"ids_{width}": rng.integers(4, 100, logprobs.shape), f"logprobs_{width}": logprobs})
    return path


def test_parallel_sampling_tiny(tmp_path, capsys):
    config = parallel_sampling.ParallelSamplingConfig(
        widths=[2], systems=["vllm", "orca_oracle"], rates={"parallel2": [2.0], "beam2": [2.0]},
        saving_rate={"alpaca": 2.0, "sharegpt": 3.0}, duration_s=10.0,
        beam_trace=str(_beam_trace(tmp_path / "beams.npz")),
        output=str(tmp_path / "ps.json"), figure=str(tmp_path / "ps.png"), saving_figure=str(tmp_path / "s.png"))
    result = parallel_sampling.run(config)
    assert set(result["memory_saving"]) == {"alpaca", "sharegpt"}
    saving = result["memory_saving"]["alpaca"]
    assert set(saving) == {"parallel", "beam_synthetic", "beam_recorded"}
    assert 0 <= saving["parallel"]["2"] < min(saving["beam_synthetic"]["2"], saving["beam_recorded"]["2"]) < 100
    branching = result["branching"]["alpaca"]
    assert set(branching) == {"beam_synthetic", "beam_recorded"}
    assert all(1 <= b["2"]["mean_parents_per_step"] <= 2 and b["2"]["beam_steps"] > 0 for b in branching.values())
    assert {p["system"] for p in result["points"]} == {"vllm", "orca_oracle"}
    assert {p["branching"] for p in result["points"]} == {"sampled", "synthetic", "recorded"}
    assert len(result["settings"]["beam_trace_sha256"]) == 64  # a new recording makes new points
    assert (tmp_path / "ps.png").exists() and (tmp_path / "s.png").exists()
    out = capsys.readouterr().out
    assert "memory_saving.alpaca.beam_recorded" in out and "one_parent_steps.alpaca.beam_synthetic" in out


def test_chatbot_tiny(tmp_path):
    config = chatbot.ChatbotConfig(systems=["vllm", "orca_max"], rates={"vllm": [0.2, 1.0], "orca_max": [0.2]},
                                   duration_s=30.0, output=str(tmp_path / "c.json"), figure=str(tmp_path / "c.png"))
    result = chatbot.run(config)
    assert len(result["points"]) == 3 and set(result["sustained_rate"]) == {"vllm", "orca_max"}
    assert json.loads((tmp_path / "c.json").read_text())["frac_prompts_at_cut"] == result["frac_prompts_at_cut"]


def test_shared_prefix_tiny(tmp_path):
    config = shared_prefix.SharedPrefixConfig(prefix_lens=[80], rates={"vllm_80": [5.0], "orca_oracle_80": [5.0]},
                                              duration_s=10.0, output=str(tmp_path / "p.json"),
                                              figure=str(tmp_path / "p.png"))
    result = shared_prefix.run(config)
    vllm = next(p for p in result["points"] if p["system"] == "vllm")
    assert vllm["prefix_cache_hit_rate"] > 0.5  # 5 of the prompt's ~6.5 blocks come from the cache
    trace = shared_prefix.make_trace(config, 80, 5.0)
    assert all((r.prompt_token_ids[:80] == trace[0].prompt_token_ids[:80]).all() for r in trace)
    assert (trace[0].prompt_token_ids[:80] == shared_prefix.make_prefix(config, 80)).all()


def test_shared_prefix_pinned_serves_the_partial_block_from_the_cache(tmp_path):
    # 85 = 5 blocks of 16 + 5 tokens: cached on use, every prompt recomputes the 5; pre-stored, none.
    rates = {"vllm_85": [5.0]}
    hit = {}
    for pin in (False, True):
        config = shared_prefix.SharedPrefixConfig(prefix_lens=[85], systems=["vllm"], rates=rates, duration_s=10.0,
                                                  pin_prefix=pin, output=str(tmp_path / f"{pin}.json"),
                                                  figure=str(tmp_path / f"{pin}.png"))
        (point,) = shared_prefix.run(config)["points"]
        assert point["prefix_pinned"] is pin
        hit[pin] = point["prefix_cache_hit_rate"]
        prompt_tokens = sum(r.prompt_len for r in shared_prefix.make_trace(config, 85, 5.0))
        num_requests = len(shared_prefix.make_trace(config, 85, 5.0))
    assert hit[True] == pytest.approx(85 * num_requests / prompt_tokens)  # the whole prefix, first request too
    assert hit[False] == pytest.approx(80 * (num_requests - 1) / prompt_tokens)


def test_block_size_tiny(tmp_path):
    config = block_size.BlockSizeConfig(block_sizes=[8, 256], rates={"alpaca": 20.0}, duration_s=5.0,
                                        output=str(tmp_path / "b.json"), figure=str(tmp_path / "b.png"))
    result = block_size.run(config)
    assert [p["block_size"] for p in result["points"]] == [8, 256] and result["best_block_size"]["alpaca"] in (8, 256)


def test_kernel_overheads_prefer_gpu_rows(tmp_path, monkeypatch):
    rows = [{"device": "cpu", "block_size": 16, "paged_over_contiguous": 2.0},
            {"device": "NVIDIA H200", "block_size": 16, "paged_over_contiguous": 1.1},
            {"device": "NVIDIA H200", "block_size": 16, "paged_over_contiguous": 0.9}]
    (tmp_path / "kb.json").write_text(json.dumps({"rows": rows}))
    monkeypatch.setattr(block_size, "REPO_ROOT", tmp_path)
    assert block_size.kernel_overheads(["kb.json", "missing.json"]) == ({16: 1.0}, "NVIDIA H200")


def test_preemption_tiny(tmp_path):
    config = preemption.PreemptionConfig(
        block_sizes=[4, 16], real_model=ModelConfig(name="tiny-opt", attention_backend="xla"), seq_len=32,
        repeats=1, duration_s=20.0, request_rate=2.0, kv_slots=1024,
        output=str(tmp_path / "r.json"), figure=str(tmp_path / "r.png"))
    result = preemption.run(config)
    assert [r["num_blocks"] for r in result["real"]] == [8, 2]
    assert all(r["swap_out_s"] > 0 and r["recompute_s"] > 0 for r in result["real"])
    slow, fast = result["modeled"]  # per-copy latency: 4x the blocks cost more to swap
    assert slow["swap_in_s"] > fast["swap_in_s"] and slow["recompute_s"] == fast["recompute_s"]
    assert {(p["mode"], p["block_size"]) for p in result["points"]} == {(m, b) for m in ("swap", "recompute")
                                                                       for b in (4, 16)}
    again = preemption.run(dataclasses.replace(config, keep_real=True, block_sizes=[16]))  # the simulated half only
    assert again["real"] == [r for r in result["real"] if r["block_size"] == 16]
    assert again["real_provenance"] == result["real_provenance"] and again["real_device"] == result["real_device"]


def test_configs_name_bad_fields():
    with pytest.raises(ValueError, match="rates.beam2"):
        parallel_sampling.ParallelSamplingConfig(widths=[2], rates={"parallel2": [1.0]}, saving_rate={"alpaca": 1,
                                                                                                     "sharegpt": 1})
    with pytest.raises(ValueError, match="beam_branching"):
        parallel_sampling.ParallelSamplingConfig(widths=[2], rates={"parallel2": [1.0], "beam2": [1.0]},
                                                 saving_rate={"alpaca": 1, "sharegpt": 1}, beam_branching=["flat"])
    with pytest.raises(ValueError, match="max_prompt_len"):
        chatbot.ChatbotConfig(rates={s: [1.0] for s in ("vllm", "orca_oracle", "orca_pow2", "orca_max")},
                              max_prompt_len=1500)
    with pytest.raises(ValueError, match="block_sizes"):
        block_size.BlockSizeConfig(block_sizes=[3], rates={"alpaca": 1.0})
    with pytest.raises(ValueError, match="rates.vllm_80"):
        shared_prefix.SharedPrefixConfig(prefix_lens=[80], rates={})
    with pytest.raises(ValueError, match="seq_len"):
        preemption.PreemptionConfig(seq_len=0)
