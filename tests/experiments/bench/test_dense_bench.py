"""experiments.bench.dense_bench: both ways agree, every row has its timings, and bad configs name the field."""

import json

import pytest

from experiments.bench import dense_bench
from pallas_kernels import native_dense_cpu

pytestmark = pytest.mark.skipif(not native_dense_cpu.available(),
                                reason=f"native dense kernel unavailable: {native_dense_cpu.unavailable_reason()}")


def test_rows_carry_timings_ratios_and_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(dense_bench, "REPO_ROOT", tmp_path)
    config = dense_bench.DenseBenchConfig(shapes=[[3, 40, 33], [8, 64, 16]], reps=2, rounds=2, output="out.json")
    result = dense_bench.run(config)
    assert [(r["m"], r["k"], r["n"], r["dtype"]) for r in result["rows"]] == [
        (3, 40, 33, "float32"), (8, 64, 16, "float32"), (3, 40, 33, "bfloat16"), (8, 64, 16, "bfloat16")]
    for row in result["rows"]:
        assert len(row["cpu_ratios"]) == 2 and row["cpu_ratio_xla_over_native"] > 0
        assert row["native_cpu_ms"] >= 0 and row["xla_wall_ms"] > 0 and row["max_abs_diff"] < 1e-4
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["rows"] == result["rows"] and "cpu" in saved["provenance"]


@pytest.mark.parametrize("field,value", [("shapes", [[8, 0, 16]]), ("shapes", []), ("dtypes", ["float16"]),
                                         ("reps", 0), ("rounds", 0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        dense_bench.DenseBenchConfig(**{field: value})
