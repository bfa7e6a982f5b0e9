"""REPORT.md generation from fixture results, the committed report's links, and reproduce_all's
quick configs."""

import json
import re

import pytest

from experiments import report, reproduce_all
from experiments.common import REPO_ROOT


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
    assert "PAPER.md" not in text and "Kwon et al." in text


def test_figures_are_embedded_where_the_png_exists(tmp_path):
    for stem, data in _fixture_results().items():
        (tmp_path / f"{stem}.json").write_text(json.dumps(data))
    (tmp_path / "chatbot.png").write_bytes(b"\x89PNG")
    text = report.write_report(tmp_path).read_text()
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
