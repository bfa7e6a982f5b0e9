"""experiments.sim_validation end to end on a few points (skipped without Vidur's CSVs)."""

import json
from pathlib import Path

import pytest

from experiments import sim_validation
from experiments.sim_validation import SimValidationConfig

DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "vidur_a100"


@pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} absent")
def test_run_few_points(tmp_path):
    config = SimValidationConfig(decode_batches=[8, 64], layer_tokens=[1, 1024], all_reduce_bytes=[2**24],
                                 opt13b_batches=[8], opt13b_contexts=[64], panels=["configs/throughput_opt175b_alpaca.yaml"],
                                 capacity_samples=2000, output=str(tmp_path / "v.json"))
    result = sim_validation.run(config)
    assert json.loads((tmp_path / "v.json").read_text())["summary"] == result["summary"]
    assert len(result["decode_steps"]) == 4 and all(0.8 < p["ratio"] < 1.25 for p in result["decode_steps"])
    assert result["all_reduce"][0]["ratio"] == pytest.approx(1.0, abs=0.1)  # 16 MB: bandwidth-bound, fitted regime
    opt = result["opt13b_decode"][0]
    assert opt["step_s"] == pytest.approx(sum(opt[f"{k}_s"] for k in ("gemm", "elementwise", "attention",
                                                                      "communication", "host")))
    (panel,) = result["panel_capacity"]
    assert panel["kv_slots"] == 3756 * 16 and panel["cap_binds"]  # Alpaca on 60.1K slots: far above 256


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="decode_batches"):
        SimValidationConfig(decode_batches=[])
    with pytest.raises(ValueError, match="capacity_samples"):
        SimValidationConfig(capacity_samples=10)
