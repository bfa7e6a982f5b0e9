"""The overlap benchmark on a tiny config: both measurements run, every round's fields are there, JSON written."""

import json

from experiments.bench import bench_overlap


def test_bench_overlap_tiny(tmp_path):
    config = bench_overlap.BenchOverlapConfig(
        num_requests=4, prompt_len=5, output_len=6, rounds=2, sim=[bench_overlap.SimPoint("opt-125m")],
        cpu_model="tiny-opt", cpu_num_requests=2, output=str(tmp_path / "o.json"))
    result = bench_overlap.run(config)
    (sim,) = result["sim"]
    assert len(sim["rounds"]) == 2
    for pair in sim["rounds"]:
        assert pair["overlapped"]["steps_ahead"] > 0 and pair["sync"]["steps_ahead"] == 0
        assert pair["sync"]["wall_s"] >= pair["sync"]["device_s"] > 0  # the device's time was waited for
    assert len(result["cpu"]["wall_ratio_overlapped_over_sync"]) == 2
    assert result["cpu"]["compilations_after_warmup"] == 0
    assert json.loads((tmp_path / "o.json").read_text())["provenance"]["config"]["rounds"] == 2
