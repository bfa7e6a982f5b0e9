"""REPORT.md generation from fixture results, the committed report's links, and reproduce_all's
quick configs."""

import json
import re

import pytest

from experiments.common import REPO_ROOT
from experiments.report import document, reproduce_all


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
        "bench_host": {"num_requests": 10, "runs": [
            {"policy": "paper", "steps": 5, "seq_steps": 50, "us_per_seq_step": 2.5, "cpu_us_per_seq_step": 2.25,
             "num_preemptions": 1}]},
        "bench_host_peer": {"summary": {"nanovllm@16": {"cpu_us_per_seq_step": 2.0, "us_per_seq_step": 2.1},
                                        "jpaged-paper@16": {"cpu_us_per_seq_step": 1.5, "us_per_seq_step": 1.6,
                                                            "cpu_ratio": 0.75, "wall_ratio": 0.76}},
                            "load_average": [3.0, 3.1, 3.2], "provenance": {"config": {"rounds": 3}}},
    }


def test_report_numbers_come_from_the_results(tmp_path):
    for stem, data in _fixture_results().items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    path = document.write_report(tmp_path)
    text = path.read_text()
    assert path == tmp_path / "REPORT.md"
    assert "| vLLM | whole run | 95.0 | 2.5 | 0.5 | 0.0 | 2.0 |  |" in text
    assert "(reserved + internal): whole run 3.0%" in text.replace("\n", " ")
    assert "Sustained rates (req/s): vLLM 1.20; Orca (Oracle) 0.60" in text
    assert "vLLM / Orca: Orca (Oracle) 2.00×, Orca (Pow2) 2.00×, Orca (Max) 2.40× (paper: 2×)" in text
    assert "| 80 | 30.00+ | 20.00 | 1.50× | 70% |" in text
    # Missing or unfinished results say how to make them.
    assert "*Not run yet: `python -m experiments.parallel_sampling --config configs/parallel_sampling.yaml`.*" in text
    assert "*Not run yet: `python -m experiments.preemption" in text
    assert text.count("## ") >= 9
    assert "PAPER.md" not in text and "Kwon et al." in text
    assert "| paper | 5 | 50 | 2.50 | 2.25 | 1 |" in text  # bench_host: one row per policy
    assert "| 16 | 2.00 | 1.50 (0.75×) |" in text and "faster than the peer in 1 of 1 cells" in text
    # Agreement is per value: Orca (Max)'s 21.0 lies inside the paper's 20.4-38.2 range.
    assert "1 of 1 within 20.4–38.2 (Orca (Max) 21.0)" in text


def test_against_places_each_value():
    from experiments.markdown import against

    assert against({"a": 1.8, "b": 1.2, "c": 3.0}, 1.7, 2.7, "{:.2f}") == \
        "1 of 3 within 1.70–2.70 (a 1.80); below: b 1.20; above: c 3.00"
    assert against({"a": 2.0}, 1.7, 2.7) == "1 of 1 within 1.7–2.7 (a 2.0)"


def test_fig13_and_figure_moves_sections(tmp_path):
    from experiments.report.figure_moves_report import figure_moves
    from experiments.throughput.report import throughput

    point = lambda system, rate, res, step: {"system": system, "request_rate": rate, "requests_resident": res,  # noqa: E731
                                             "requests_per_step": step, "normalized_latency": 0.1}
    results = {"throughput_opt13b_sharegpt": {"points": [point("orca_max", 2.0, 7.0, 6.8), point("vllm", 2.0, 28.0, 25.0)]},
               "figure_moves": {"before": {"rev": "a" * 40}, "rows": [
                   {"quantity": "Fig. 17 vLLM sustained (req/s)", "before": 1.0, "attribution": None, "after": 0.5}],
                   "old_cost_model": {"rev": "fe10aba", "rows": [
                       {"model": "opt-13b", "kind": "decode", "batch": 8, "ratio": 1.01, "fitted_ratio": 1.2},
                       {"model": "opt-13b", "kind": "decode", "batch": 128, "ratio": 1.02, "fitted_ratio": 2.0},
                       {"model": "opt-13b", "kind": "prompt", "batch": 1, "ratio": 1.04, "fitted_ratio": 1.1}]}}}
    text = throughput(results, document.Figures(tmp_path))
    assert "| ShareGPT 2 req/s | Orca (Max) | 7.00 | 7.00 (+0.0%) | 6.80 (-2.9%) | resident |" in text
    assert "Requests resident is the closer count for 2 of 2 bars" in text and "The Orca (Max) bars decide it" in text
    moves = figure_moves(results, document.Figures(tmp_path))
    assert "| Fig. 17 vLLM sustained (req/s) | 1.00 | 0.50 | -50% |" in moves
    assert "1 of 1 quantities moved by more than 10%" in moves


def test_figures_are_embedded_where_the_png_exists(tmp_path):
    for stem, data in _fixture_results().items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    (tmp_path / "chatbot.png").write_bytes(b"\x89PNG")
    text = document.write_report(tmp_path).read_text()
    assert "![Fig. 17: normalized latency vs request rate, chatbot](chatbot.png)" in text
    chatbot = text[text.index("## Fig. 17"):text.index("## Fig. 18")]
    assert chatbot.index("Sustained rates") < chatbot.index("![Fig. 17")  # beside its numbers
    shared = text[text.index("## Fig. 16"):text.index("## Fig. 17")]
    assert "](" not in shared and "*No figure yet" in shared  # shared_prefix.png is missing
    assert "| `chatbot.json` | `?` ? (file) |" in text  # no provenance: said so


# Backticked mentions of files: a path with a folder or a name with one of these extensions.
_FILE_MENTION = re.compile(r"`([\w./*<>-]+\.(?:py|json|png|yaml|md|sh))(?:::\w+)?`")


def test_committed_report_points_only_to_files_that_exist():
    """Every image, link and file the committed results/REPORT.md names exists in this repository
    (a name without a folder lives beside the report; `*` and `<config>` match any file)."""
    results = REPO_ROOT / "results"
    text = (results / "REPORT.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert any(link.endswith(".png") for link in links)
    for link in links:
        assert (results / link).is_file(), f"REPORT.md links to {link}, which is not in results/"
    for name in _FILE_MENTION.findall(text):
        pattern = name.replace("<config>", "*")
        where = results if "/" not in name else REPO_ROOT
        assert list(where.glob(pattern)), f"REPORT.md names {name}, which matches no file under {where}"
    for name in re.findall(r"--config (configs/[\w.]+\.yaml)", text):
        assert (REPO_ROOT / name).is_file(), f"REPORT.md's command names {name}, which does not exist"
    assert "PAPER.md" not in text  # the paper's notes live outside this repository: cite the paper


@pytest.mark.parametrize("module, config", [s for s in reproduce_all.STEPS if s[1] not in reproduce_all.SLOW])
def test_quick_configs_load_and_write_under_results_quick(module, config):
    run, cfg = reproduce_all.load_step(module, config, quick=True)
    assert callable(run) and cfg.output.startswith("results/quick/")
