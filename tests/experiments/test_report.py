"""REPORT.md generation from fixture results, and reproduce_all's quick configs."""

import json

import pytest

from experiments import report, reproduce_all


def _fixture_results():
    sweep = lambda **rates: {"sustained_rate": rates, "sustained_rate_censored": {s: None for s in rates}}  # noqa: E731
    return {
        "memory_waste": {"systems": {"vllm": dict(token_states=95.0, reserved=2.5, internal=0.5, external=0.0, free=2.0),
                                     "orca_max": dict(token_states=21.0, reserved=10, internal=60, external=9, free=0)},
                         "provenance": {"config": {"model": {"name": "opt-13b"}, "sim": {"tp": 1, "gpu": "a100-40gb"},
                                                   "dataset": "sharegpt", "request_rate": 3.0, "duration_s": 600}}},
        "chatbot": sweep(vllm=1.2, orca_oracle=0.6, orca_pow2=0.6, orca_max=0.5) | {
            "total_wall_s": 10.0, "mean_prompt_len": 700.0, "mean_output_len": 300.0, "frac_prompts_at_cut": 0.5,
            "provenance": {"config": {"mean_rounds": 4.0, "max_prompt_len": 1024}}},
        "shared_prefix": {"sustained_rate": {"80": {"vllm": 30.0, "orca_oracle": 20.0}},
                          "sustained_rate_censored": {"80": {"vllm": "above_sweep", "orca_oracle": None}},
                          "points": [{"prefix_len": 80, "system": "vllm", "prefix_cache_hit_rate": 0.7}],
                          "total_wall_s": 5.0, "provenance": {"config": {
                              "model": {"name": "llama-13b"}, "sim": {"tp": 1, "gpu": "a100-40gb"}, "executor": "sim",
                              "input_median": 24.0, "output_ratio": 1.2}}},
        "parallel_sampling": {"points": [{"dataset": "alpaca"}]},  # a sweep still in progress
    }


def test_report_numbers_come_from_the_results(tmp_path):
    for stem, data in _fixture_results().items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    path = report.write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "REPORT.md"
    assert "| vLLM | 95.0 | 2.5 | 0.5 | 0.0 | 2.0 |" in text
    assert "vLLM wastes\n3.0%" in text or "vLLM wastes 3.0%" in text.replace("\n", " ")
    assert "Sustained rates (req/s): vLLM 1.20; Orca (Oracle) 0.60" in text
    assert "vLLM sustains 2.00–2.40× the Orca variants' rates" in text
    assert "| 80 | 30.00+ | 20.00 | 1.50× | 70% |" in text
    # Missing or unfinished results say how to make them.
    assert "*Not run yet: `python -m experiments.parallel_sampling --config configs/parallel_sampling.yaml`.*" in text
    assert "*Not run yet: `python -m experiments.preemption" in text
    assert text.count("## ") >= 9


@pytest.mark.parametrize("module, config", [s for s in reproduce_all.STEPS if s[1] not in reproduce_all.SLOW])
def test_quick_configs_load_and_write_under_results_quick(module, config):
    run, cfg = reproduce_all.load_step(module, config, quick=True)
    assert callable(run) and cfg.output.startswith("results/quick/")
