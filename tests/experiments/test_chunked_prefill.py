"""experiments.chunked_prefill: a tiny sweep of both policies end to end, ITL recorded, the real run."""

import json

import numpy as np
import pytest

from experiments import chunked_prefill
from experiments.chunked_prefill import ChunkedPrefillConfig, RealRun, Variant
from jpaged.config import CacheConfig
from jpaged.paper.metrics import summarize_token_times

VARIANTS = [Variant("paper", "paper", 2048), Variant("chunked-256", "chunked", 256)]


def test_sweep_and_real_run_write_every_metric(tmp_path, capsys):
    config = ChunkedPrefillConfig(variants=VARIANTS, rates=[1.0, 4.0], duration_s=30.0,
                                  cache=CacheConfig(num_blocks=984, num_host_blocks=0),
                                  real=RealRun(num_requests=6, request_rate=50.0),
                                  output=str(tmp_path / "cp.json"), figure=str(tmp_path / "cp.png"))
    result = chunked_prefill.run(config)
    assert json.loads((tmp_path / "cp.json").read_text())["sustained_rate"] == result["sustained_rate"]
    assert (tmp_path / "cp.png").stat().st_size > 0 and len(result["points"]) == 4
    for point in result["points"]:
        for key in ("normalized_latency", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                    "median_tpot_ms", "requests_per_step", "requests_resident", "provenance"):
            assert key in point
    by = {(p["variant"], p["request_rate"]): p for p in result["points"]}
    # The same requests are served whatever the policy; at load, chunks shorten the worst token gap.
    assert by["paper", 4.0]["completed"] == by["chunked-256", 4.0]["completed"]
    assert by["chunked-256", 4.0]["p99_itl_ms"] < by["paper", 4.0]["p99_itl_ms"]
    assert [r["variant"] for r in result["real"]["rows"]] == ["paper", "chunked-256"]
    assert all(r["completed"] == 6 and r["median_itl_ms"] > 0 for r in result["real"]["rows"])
    assert "sustained_rate.chunked-256" in capsys.readouterr().out


def test_itl_pools_the_gaps_of_every_request():
    stats = summarize_token_times({"a": [0.0, 0.1, 0.3], "b": [1.0, 1.4], "c": [5.0]})
    assert stats["mean_itl_ms"] == pytest.approx(np.mean([100, 200, 400]))
    assert stats["median_itl_ms"] == pytest.approx(200)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="variants"):
        ChunkedPrefillConfig(variants=[VARIANTS[0], VARIANTS[0]], rates=[1.0])
    with pytest.raises(ValueError, match="rates"):
        ChunkedPrefillConfig(variants=VARIANTS, rates=[])
