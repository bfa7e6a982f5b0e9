"""The decode-step micro-benchmark on a tiny config: one compile, a timing per model, JSON written."""

import json

from experiments.bench import bench_decode


def test_bench_decode_tiny(tmp_path):
    config = bench_decode.BenchDecodeConfig(models=["tiny-opt", "tiny-llama"], num_seqs=3, context_len=20,
                                            block_size=8, warmup_steps=1, steps=3, output=str(tmp_path / "b.json"))
    result = bench_decode.run(config)
    assert [row["model"] for row in result["models"]] == ["tiny-opt", "tiny-llama"]
    for row in result["models"]:
        assert row["num_compilations"] == 1  # the same decode shape every step
        assert row["wall_us_per_step"] > 0 and row["cpu_us_per_step"] > 0
    assert json.loads((tmp_path / "b.json").read_text())["provenance"]["config"]["steps"] == 3
