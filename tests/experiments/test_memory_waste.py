"""experiments.memory_waste: a tiny run end to end — breakdown per system, figures, ordering."""

import json

import pytest

from experiments import memory_waste
from experiments.memory_waste import MemoryWasteConfig


def test_run_tiny(tmp_path):
    config = MemoryWasteConfig(duration_s=30.0, picture_start_s=10.0, picture_window_s=10.0, picture_interval_s=1.0,
                               output=str(tmp_path / "mw.json"), figure=str(tmp_path / "mw.png"),
                               pool_figure=str(tmp_path / "pool.png"))
    result = memory_waste.run(config)
    assert json.loads((tmp_path / "mw.json").read_text())["systems"] == result["systems"]
    assert (tmp_path / "mw.png").stat().st_size > 0 and (tmp_path / "pool.png").stat().st_size > 0
    systems = result["systems"]
    assert list(systems) == ["vllm", "orca_max", "orca_pow2", "orca_oracle"]
    for usage in systems.values():
        assert sum(usage.values()) == pytest.approx(100.0)
    # The paper's ordering: reserving less stores more token states; paged wastes the least.
    token = {s: v["token_states"] for s, v in systems.items()}
    assert token["orca_max"] < token["orca_pow2"] < token["orca_oracle"] < token["vllm"]
    assert systems["vllm"]["reserved"] + systems["vllm"]["internal"] < 4.0
    assert systems["vllm"]["external"] == 0.0 and systems["orca_max"]["internal"] > 40.0


def test_fastertransformer_is_not_a_fig2_system():
    with pytest.raises(ValueError, match="fastertransformer"):
        MemoryWasteConfig(systems=["vllm", "fastertransformer"])
