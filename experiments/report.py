"""results/REPORT.md, generated whole from the JSON results: every number in it comes from a file.

Each section puts a figure beside the paper's claim, the command that made it, and a sentence on
where ours agrees or differs and why. A section whose JSON is missing says so and how to make it.
The prose that explains differences lives here; any number it cites is read from the results.

    python -m experiments.report            # rewrite results/REPORT.md from results/*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.common import REPO_ROOT
from experiments.report_sections import (chatbot, header, host_and_real_engine, kernel_and_block_size, memory_waste,
                                         parallel_sampling, preemption, real_executor, shared_prefix, throughput)

SECTIONS = (header, memory_waste, throughput, real_executor, parallel_sampling, shared_prefix, chatbot,
            kernel_and_block_size, preemption, host_and_real_engine)


def load_results(results_dir: Path) -> dict[str, dict]:
    """Every results/*.json by file stem ("throughput_opt13b_sharegpt" -> its parsed JSON)."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(Path(results_dir).glob("*.json"))}


def render(results: dict[str, dict]) -> str:
    """The whole REPORT.md text from the loaded results."""
    return "\n\n".join(section(results).strip() for section in SECTIONS) + "\n"


def write_report(results_dir: Path = REPO_ROOT / "results", path: Path | None = None) -> Path:
    """Renders the report from `results_dir` and writes it (default: REPORT.md beside the results)."""
    path = Path(path or Path(results_dir) / "REPORT.md")
    path.write_text(render(load_results(results_dir)))
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="folder of the JSON results")
    args = parser.parse_args()
    print(write_report(Path(args.results)))
