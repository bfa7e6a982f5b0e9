"""experiments.fleet: a tiny sweep end to end (JSON, figure, the REPORT section), curves stopping past
their crossing, resuming, and config errors that name the field."""

import json

import pytest

from experiments import fleet
from experiments.fleet import Deployment, FleetConfig, MultiTurnWorkload, SharedPrefixWorkload
from experiments.fleet.report import fleet_section
from experiments.markdown import Figures
from jpaged.config import CacheConfig, SchedulerConfig, config_from_dict

RATES = {"shared_prefix": [5.0, 100.0], "multi_turn": [2.0, 40.0]}


def tiny_config(tmp_path, **overrides) -> FleetConfig:
    fields = dict(
        deployments=[Deployment(name="one-gpu", model="opt-125m", num_blocks=64, rates_per_replica=RATES),
                     Deployment(name="two-hosts", model="opt-1.3b", tp=2, hosts=2, num_blocks=64, rates_per_replica=RATES)],
        replicas=[1, 2],
        shared_prefix=SharedPrefixWorkload(num_prefixes=4, prefix_len=64, input_median=8, output_median=8, warmup_s=0.5,
                                           warmup_requests=3, duration_s=1.0),
        multi_turn=MultiTurnWorkload(mean_turns=3, think_mean_s=0.5, max_output_len=24, warmup_s=1.0, duration_s=1.5),
        scheduler=SchedulerConfig(policy="paper", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=32),
        cache=CacheConfig(block_size=16, num_host_blocks=0),
        output=str(tmp_path / "fleet.json"), figure=str(tmp_path / "fleet.png"))
    return FleetConfig(**(fields | overrides))


def test_run_writes_sustained_rates_hit_rates_figure_and_report(tmp_path, capsys):
    result = fleet.run(tiny_config(tmp_path))
    assert json.loads((tmp_path / "fleet.json").read_text())["sustained"] == result["sustained"]
    assert (tmp_path / "fleet.png").stat().st_size > 0
    for name in ("one-gpu", "two-hosts"):
        for workload in ("shared_prefix", "multi_turn"):
            assert result["latency_threshold"][name][workload] > 0
            for policy in ("round_robin", "cache_aware"):
                for r in ("1", "2"):
                    found = result["sustained"][name][workload][policy][r]
                    assert found["rate"] > 0 and 0 <= found["prefix_hit_rate"] <= 1
    point = result["points"][0]
    for key in ("deployment", "workload", "policy", "replicas", "rate_per_replica", "request_rate",
                "normalized_latency", "prefix_hit_rate", "decisions", "requests_per_replica", "warmup_s",
                "mean_ttft_ms", "provenance"):
        assert key in point
    assert point["request_rate"] == point["replicas"] * point["rate_per_replica"]
    costs = result["step_costs_ms"]
    assert set(costs) == {"two-hosts"}  # only a replica spanning servers pays the link
    prefill = costs["two-hosts"]["prefill_1024"]
    assert prefill["cross_host"]["communication"] > prefill["one_nvlink_domain"]["communication"] > 0
    assert prefill["cross_host"]["gemm"] == prefill["one_nvlink_domain"]["gemm"]
    assert "sustained.one-gpu.shared_prefix.cache_aware" in capsys.readouterr().out
    section = fleet_section({"fleet": result}, Figures(tmp_path))
    assert "![" in section and "two-hosts" in section and "round-robin" in section


def test_report_section_without_a_result_gives_the_command(tmp_path):
    assert "python -m experiments.fleet --config configs/fleet.yaml" in fleet_section({}, Figures(tmp_path))


def test_a_curve_stops_after_its_first_point_over_the_threshold(tmp_path):
    rates = {"shared_prefix": [5.0, 400.0, 800.0]}
    config = tiny_config(tmp_path, workloads=["shared_prefix"], replicas=[1], policies=["round_robin"],
                         deployments=[Deployment(name="one-gpu", model="opt-125m", num_blocks=64, rates_per_replica=rates)])
    result = fleet.run(config)
    assert [p["rate_per_replica"] for p in result["points"]] == [5.0, 400.0]  # 800 lies past the crossing
    assert result["sustained"]["one-gpu"]["shared_prefix"]["round_robin"]["1"]["censored"] is None


def test_resume_keeps_finished_points(tmp_path, monkeypatch, capsys):
    config = tiny_config(tmp_path, workloads=["shared_prefix"], replicas=[1], policies=["round_robin"])
    first = fleet.run(config)
    ran = []
    real = fleet.run_point
    monkeypatch.setattr(fleet, "run_point", lambda c, *key: ran.append(key) or real(c, *key))
    second = fleet.run(config, resume=True)
    assert ran == [] and "reused 4 of 4 points" in capsys.readouterr().out
    assert [p["provenance"] for p in second["points"]] == [p["provenance"] for p in first["points"]]


@pytest.mark.parametrize("change,message", [
    ({"policies": ["random"]}, "policies must be a non-empty list of round_robin, cache_aware"),
    ({"workloads": ["chat"]}, "workloads must be a non-empty list of shared_prefix, multi_turn"),
    ({"replicas": [0]}, "replicas must be a non-empty list of ints >= 1"),
    ({"latency_threshold_factor": 1.0}, "latency_threshold_factor must be > 1"),
    ({"deployments": [{"name": "x", "model": "opt-125m", "num_blocks": 64, "rates_per_replica": {"shared_prefix": [1.0]}}]},
     "deployments.x.rates_per_replica.multi_turn must be a non-empty list"),
    ({"deployments": [{"name": "x", "model": "gpt-9", "num_blocks": 64, "rates_per_replica": RATES}]},
     "deployments.x.model: model name must be one of"),
    ({"deployments": [{"name": "x", "model": "opt-125m", "tp": 4, "hosts": 3, "num_blocks": 64, "rates_per_replica": RATES}]},
     "deployments.x: tp must be >= 1 and hosts >= 1 dividing it"),
    ({"shared_prefix": {"zipf_s": -1.0}}, "shared_prefix.zipf_s must be >= 0"),
    ({"multi_turn": {"think_mean_s": -1.0}}, "multi_turn.think_mean_s must be >= 0"),
    ({"router": {"cache_threshold": 2.0}}, "router.cache_threshold must be in"),
])
def test_config_errors_name_the_field(change, message):
    data = {"deployments": [{"name": "x", "model": "opt-125m", "num_blocks": 64, "rates_per_replica": RATES}]} | change
    with pytest.raises(ValueError, match=message):
        config_from_dict(FleetConfig, data)
