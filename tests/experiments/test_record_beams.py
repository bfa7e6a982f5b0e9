"""Recorded beam searches replay exactly in the simulator; BeamReplay's file checks and step wrap."""

import numpy as np
import pytest

from experiments import record_beams
from jpaged.config import ModelConfig
from jpaged.config.presets import get_preset
from jpaged.engine import LLMEngine
from jpaged.paper.sim.executor import BeamReplay, SimExecutor
from jpaged.paper.systems import make_scheduler


def test_a_recorded_search_replays_exactly_in_the_simulator(tmp_path):
    """tiny-llama's real beam search (dummy weights, real executor) recorded, then replayed on the
    simulator: the same beams come out, token for token, with the same scores and branching."""
    config = record_beams.RecordBeamsConfig(
        model=ModelConfig(name="tiny-llama", attention_backend="xla"), prompts="random", widths=[3],
        num_traces=1, prompt_len=8, max_tokens=10, max_num_seqs=8, num_blocks=32,
        output=str(tmp_path / "beams.npz"), summary=str(tmp_path / "beams.json"))
    summary = record_beams.run(config)
    prompt = record_beams.make_prompts(config, 1, get_preset("tiny-llama").vocab_size)[0][0]
    from jpaged.executors.jax import JaxExecutor

    real_config = record_beams.engine_config(config, "jax")
    real = LLMEngine(real_config, JaxExecutor(real_config), make_scheduler("vllm", real_config))
    real_meter, real_out = record_beams.search(real, [prompt], 3, config.max_tokens)
    replay = BeamReplay(tmp_path / "beams.npz")
    assert replay.widths == [3]
    sim_config = record_beams.engine_config(config, "sim")
    sim = LLMEngine(sim_config, SimExecutor(get_preset("tiny-llama"), candidates=replay),
                    make_scheduler("vllm", sim_config))
    sim_meter, sim_out = record_beams.search(sim, [prompt], 3, config.max_tokens)
    ours, theirs = real_out["0"].outputs, sim_out["0"].outputs
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs] and len(ours) == 3
    assert [c.cumulative_logprob for c in ours] == pytest.approx([c.cumulative_logprob for c in theirs], abs=1e-5)
    assert real_meter.parents == sim_meter.parents
    recorded = summary["widths"]["3"]["recorded"]
    assert {k: recorded[k] for k in real_meter.summary()} == real_meter.summary()
    assert recorded["mean_top1_logprob"] < 0 and recorded["mean_top1_top2_gap"] >= 0


def test_replay_checks_its_file_and_wraps_past_the_recording(tmp_path):
    with pytest.raises(FileNotFoundError, match="record_beams"):
        BeamReplay(tmp_path / "missing.npz")
    np.savez(tmp_path / "bad.npz", ids_2=np.zeros((1, 4, 2, 3)), logprobs_2=np.zeros((1, 4, 2, 3)))
    with pytest.raises(ValueError, match=r"logprobs_2 must be \[K, L, 2, 4\]"):
        BeamReplay(tmp_path / "bad.npz")
    np.savez(tmp_path / "ok.npz", ids_2=np.zeros((1, 8, 2, 4)), logprobs_2=np.zeros((1, 8, 2, 4)))
    replay = BeamReplay(tmp_path / "ok.npz")
    assert [replay.step_of(t, 8) for t in (0, 7, 8, 9, 11, 12, 13)] == [0, 7, 4, 5, 7, 4, 5]

