"""experiments.bench.profile_executor: synthetic plans are well formed; the real executor profiled on a
tiny grid, fitted on half, checked on the rest."""

import pytest

from experiments.bench import profile_executor
from experiments.bench.profile_executor import ProfileExecutorConfig, synthetic_plan
from jpaged.config import ModelConfig


def test_synthetic_plan_is_well_formed():
    plan = synthetic_plan([5, 20], [5, 30], block_size=4, num_blocks=9, vocab_size=256)
    assert plan.padded_shape == (32, 8, 8) and plan.num_tokens == 25
    assert list(plan.query_start_loc[:3]) == [0, 5, 25]
    # Token 2 of sequence 1 sits at position 12: block table entry 3, offset 0.
    assert plan.positions[7] == 12 and plan.slot_mapping[7] == plan.block_tables[1, 3] * 4
    assert (plan.block_tables[:2] < 9).all() and plan.block_tables[0, 2:].sum() == 0
    assert list(plan.logits_indices[:2]) == [4, 24]
    decode = synthetic_plan([1, 1, 1], [7, 8, 9], block_size=4, num_blocks=9, vocab_size=256)
    assert decode.padded_shape == (8, 8, 8) and list(decode.positions[:3]) == [6, 7, 8]
    with pytest.raises(ValueError, match="query_lens"):
        synthetic_plan([6], [5], block_size=4, num_blocks=9, vocab_size=256)


@pytest.mark.slow
def test_profile_fits_the_held_out_shapes(tmp_path):
    config = ProfileExecutorConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"), num_blocks=65,
                                   decode_batches=[1, 2, 4], decode_contexts=[8, 32], prefill_tokens=[8, 16, 32],
                                   repeats=1, gpu="h100", output=str(tmp_path / "p.json"))
    result = profile_executor.run(config)
    assert len(result["rows"]) == 15 and sum(r["held_out"] for r in result["rows"]) == 7
    assert all(r["measured_s"] > 0 and r["fitted_s"] > 0 and r["roofline_s"] > 0 for r in result["rows"])
    assert set(result["summary"]) >= {"held_out_median_abs_error", "roofline_over_measured_median"}


def test_bad_grid_and_gpu_names_are_refused():
    with pytest.raises(ValueError, match="decode_batches"):
        ProfileExecutorConfig(decode_batches=[])
    with pytest.raises(ValueError, match="gpu"):
        ProfileExecutorConfig(gpu="a42")
