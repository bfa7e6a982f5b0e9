"""experiments.throughput: a tiny sweep end to end, opt-in resuming with per-point provenance,
sustained rates, config errors."""

import json

import pytest

from experiments import throughput
from experiments.throughput import ThroughputConfig, sustained_rates
from jpaged.config import CacheConfig, config_from_dict


def tiny_config(tmp_path, **overrides):
    fields = dict(systems=["vllm", "orca_max"], rates={"vllm": [1.0, 6.0], "orca_max": [1.0, 6.0]},
                  duration_s=20.0, cache=CacheConfig(num_blocks=984, num_host_blocks=0),
                  output=str(tmp_path / "tp.json"), figure=str(tmp_path / "tp.png"))
    return ThroughputConfig(**(fields | overrides))


def test_run_writes_points_sustained_rates_and_figure(tmp_path, capsys):
    result = throughput.run(tiny_config(tmp_path))
    assert json.loads((tmp_path / "tp.json").read_text())["sustained_rate"] == result["sustained_rate"]
    assert (tmp_path / "tp.png").stat().st_size > 0
    assert len(result["points"]) == 4
    point = result["points"][0]
    for key in ("system", "request_rate", "normalized_latency", "avg_batched_requests", "request_throughput",
                "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "num_preemptions", "wall_s"):
        assert key in point
    assert set(result["sustained_rate"]) == {"vllm", "orca_max"}
    assert result["provenance"]["config"]["duration_s"] == 20.0
    assert "sustained_rate.vllm" in capsys.readouterr().out


def _counting_run_point(monkeypatch) -> list:
    ran = []
    real = throughput.run_point
    monkeypatch.setattr(throughput, "run_point", lambda c, s, r: ran.append((s, r)) or real(c, s, r))
    return ran


def test_plain_run_computes_every_point_even_when_the_json_has_them(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, systems=["vllm"], rates={"vllm": [1.0]})
    throughput.run(config)
    ran = _counting_run_point(monkeypatch)
    second = throughput.run(config)
    assert ran == [("vllm", 1.0)]
    assert second["points"][0]["provenance"] == {k: v for k, v in second["provenance"].items() if k != "config"}


def test_resume_keeps_finished_points_with_their_own_provenance(tmp_path, monkeypatch, capsys):
    first = throughput.run(tiny_config(tmp_path, systems=["vllm"], rates={"vllm": [1.0]}))
    stamp = first["points"][0]["provenance"]
    assert stamp["git_sha"] == first["provenance"]["git_sha"] and "config" not in stamp
    capsys.readouterr()
    ran = _counting_run_point(monkeypatch)
    result = throughput.run(tiny_config(tmp_path, systems=["vllm"], rates={"vllm": [1.0, 2.0]}), resume=True)
    assert ran == [("vllm", 2.0)] and len(result["points"]) == 2
    assert "reused 1 of 2 points" in capsys.readouterr().out
    kept = next(p for p in result["points"] if p["request_rate"] == 1.0)
    assert kept["provenance"] == stamp  # the run that computed it, not this one
    saved = json.loads((tmp_path / "tp.json").read_text())
    assert saved["points"] == result["points"] and saved["provenance"] == result["provenance"]
    ran.clear()
    throughput.run(tiny_config(tmp_path, systems=["vllm"], rates={"vllm": [1.0]}, seed=1), resume=True)
    assert ran == [("vllm", 1.0)]  # other settings: nothing to reuse


def test_resume_recomputes_points_without_provenance(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, systems=["vllm"], rates={"vllm": [1.0]})
    throughput.run(config)
    saved = json.loads((tmp_path / "tp.json").read_text())
    for point in saved["points"]:
        del point["provenance"]  # a file written before points carried their own
    (tmp_path / "tp.json").write_text(json.dumps(saved))
    ran = _counting_run_point(monkeypatch)
    throughput.run(config, resume=True)
    assert ran == [("vllm", 1.0)]


def test_sustained_rate_interpolates_and_flags_censoring():
    points = [{"system": "a", "request_rate": r, "normalized_latency": lat} for r, lat in
              [(1.0, 0.1), (2.0, 0.2), (3.0, 0.6)]] + [{"system": "b", "request_rate": 1.0, "normalized_latency": 0.1}]
    out = sustained_rates(points, ["a", "b"], threshold=0.4)
    assert out["a"] == {"rate": pytest.approx(2.5), "censored": None}
    assert out["b"] == {"rate": 1.0, "censored": "above_sweep"}
    assert sustained_rates(points, ["a"], threshold=0.05)["a"]["censored"] == "below_sweep"


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rates.orca_max"):
        ThroughputConfig(systems=["orca_max"], rates={})
    with pytest.raises(ValueError, match="system must be one of"):
        ThroughputConfig(systems=["orca"], rates={"orca": [1.0]})
    with pytest.raises(ValueError, match="unknown key"):
        config_from_dict(ThroughputConfig, {"sytems": ["vllm"]})


@pytest.mark.slow
def test_real_executor_config_runs(tmp_path):
    """The CPU real-model config (tiny-opt, executor: jax) through the same code path."""
    from jpaged.config import load_config

    config = load_config(throughput.REPO_ROOT / "configs/throughput_tiny_jax.yaml", ThroughputConfig)
    config = ThroughputConfig(**(vars(config) | dict(output=str(tmp_path / "j.json"), figure=str(tmp_path / "j.png"))))
    result = throughput.run(config)
    assert all(p["completed"] > 0 for p in result["points"])
