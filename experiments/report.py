"""results/REPORT.md, generated whole from the JSON results: every number in it comes from a file.

Each section puts our table and figure (the PNG beside REPORT.md, embedded) beside the paper's
claim, the command that made them, and a sentence on where ours agrees or differs and why. A
section whose JSON is missing says so and how to make it. The prose that explains differences
lives in report_sections.py, report_simulator.py, report_throughput.py, report_sharing.py and
report_ablations.py; any number it cites is read from the results.

    python -m experiments.report            # rewrite results/REPORT.md from results/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.common import REPO_ROOT
from experiments.report_ablations import chunked_prefill, kernel_and_block_size, preemption
from experiments.report_sections import Figures, header, host_and_real_engine, memory_waste, provenance, real_executor
from experiments.report_sharing import chatbot, parallel_sampling, shared_prefix
from experiments.report_simulator import figure_moves, sim_validation
from experiments.report_throughput import throughput

SECTIONS = (header, sim_validation, figure_moves, memory_waste, throughput, real_executor, parallel_sampling,
            shared_prefix, chatbot, kernel_and_block_size, preemption, chunked_prefill, host_and_real_engine,
            provenance)


def load_results(results_dir: Path) -> dict[str, dict]:
    """Every results/*.json by file stem ("throughput_opt13b_sharegpt" -> its parsed JSON)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(Path(results_dir).glob("*.json"))}


def render(results: dict[str, dict], figures: Figures) -> str:
    """The whole REPORT.md text from the loaded results and the figures beside it."""
    return "\n\n".join(section(results, figures).strip() for section in SECTIONS) + "\n"


def write_report(results_dir: Path = REPO_ROOT / "results") -> Path:
    """Renders the report from `results_dir` and writes it there as REPORT.md (beside the figures
    it embeds by file name); returns its path."""
    path = Path(results_dir) / "REPORT.md"
    path.write_text(render(load_results(results_dir), Figures(results_dir)))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="folder of the JSON results")
    args = parser.parse_args()
    print(write_report(Path(args.results)))
