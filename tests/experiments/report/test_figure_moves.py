"""figure_moves: headline numbers read alike from older and newer result layouts."""

from experiments.report import figure_moves


def test_old_and_new_layouts_give_the_same_quantities():
    old = {"parallel_sampling": {"memory_saving": {"alpaca": {"beam": {"2": 40.0}}},
                                 "sustained_rate": {"alpaca.beam2": {"vllm": 30.0}}},
           "throughput_opt13b_sharegpt": {"sustained_rate": {"vllm": 2.5},
                                          "points": [{"system": "vllm", "request_rate": 2.0, "avg_batched_requests": 24.0}]}}
    new = {"parallel_sampling": {"memory_saving": {"alpaca": {"beam_synthetic": {"2": 42.0}, "beam_recorded": {"2": 30.0}}},
                                 "sustained_rate": {"alpaca.beam_synthetic2": {"vllm": 16.0}}},
           "throughput_opt13b_sharegpt": {"sustained_rate": {"vllm": 2.2}, "points": [
               {"system": "vllm", "request_rate": 2.0, "avg_batched_requests": 25.0, "requests_per_step": 25.0,
                "requests_resident": 27.0}]}}
    before, after = figure_moves.headline(old), figure_moves.headline(new)
    key = "Fig. 15 alpaca beam_synthetic width 2 memory saving (%)"
    assert before[key] == 40.0 and after[key] == 42.0
    assert after["Fig. 15 alpaca beam_recorded width 2 memory saving (%)"] == 30.0
    assert before["Fig. 14 alpaca beam_synthetic width 2 vLLM sustained (req/s)"] == 30.0
    assert before["Fig. 12(a) vLLM sustained (req/s)"] == 2.5
    per_step = "Fig. 13 ShareGPT 2 req/s vLLM requests per step"
    assert before[per_step] == 24.0 and after[per_step] == 25.0
    assert "Fig. 13 ShareGPT 2 req/s vLLM requests resident" not in before  # older files: per step only
    assert after["Fig. 13 ShareGPT 2 req/s vLLM requests resident"] == 27.0
