"""experiments.bench.profile_executor: the real executor profiled on a tiny grid, fitted on half, checked on the rest."""

import pytest

from experiments.bench import profile_executor
from experiments.bench.profile_executor import ProfileExecutorConfig
from jpaged.config import ModelConfig


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
