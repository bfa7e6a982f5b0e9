"""experiments.bench.spec_decode's workload sizes: how many batches a timed run serves."""

from __future__ import annotations

import pytest

from experiments.bench.spec_decode import SpecDecodeConfig


def test_a_run_serves_rounds_batches_or_enough_to_reach_min_prompts():
    config = SpecDecodeConfig(rounds=4, min_prompts=16)
    assert [config.rounds_at(b) for b in (1, 2, 3, 4, 64)] == [16, 8, 6, 4, 4]
    assert SpecDecodeConfig(rounds=4).rounds_at(1) == 4  # min_prompts 0: rounds alone


def test_min_prompts_below_zero_is_refused_by_name():
    with pytest.raises(ValueError, match="min_prompts"):
        SpecDecodeConfig(min_prompts=-1)
