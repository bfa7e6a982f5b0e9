"""results/REPORT.md, generated whole from the JSON results: every number in it comes from a file.

Each section puts our table and figure (the PNG beside REPORT.md, embedded) beside the paper's
claim, the command that made them, and a sentence on where ours agrees or differs and why. A
section whose JSON is missing says so and how to make it. This module holds the report's order, its
opening and its provenance table; a figure's section lives beside its experiment
(experiments/<name>/report.py), the engine's in engine.py, the moved figures' in
figure_moves_report.py, and what they share in experiments/markdown.py.

    python -m experiments.report [--results DIR]     # rewrite DIR/REPORT.md (default results/)
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from experiments.ablation.report import ablations
from experiments.block_size.report import block_size
from experiments.chatbot.report import chatbot
from experiments.chunked_prefill.report import chunked_prefill
from experiments.common import REPO_ROOT
from experiments.conversation.report import conversation
from experiments.fleet.report import fleet_section
from experiments.kernel_bench.report import kernel_bench
from experiments.memory_waste.report import memory_waste
from experiments.parallel_sampling.report import parallel_sampling
from experiments.preemption.report import preemption
from experiments.report.engine import host_and_real_engine, real_executor, serving_against_vllm, spec_decode, startup
from experiments.report.figure_moves_report import figure_moves
from experiments.markdown import PAPER, Figures
from experiments.shared_prefix.report import shared_prefix
from experiments.sim_validation.report import sim_validation
from experiments.spec_sim.report import spec_sim
from experiments.throughput.report import throughput


def header(results: dict, figures: Figures) -> str:
    return f"""# jpaged results against the paper

The paper: {PAPER}.

Each section: the paper's claim (naming the section or figure it comes from; "our reading": numbers
we read off its text and plots), our numbers and figure, the command that made them, and where and
why the two differ. This file is generated: `python -m experiments.report` (or
`python -m experiments.report.reproduce_all`) rewrites it from the JSON results beside it, so every number
below comes from a committed result; file names without a folder are beside this file, and the last
section lists which runs (git sha, date) computed each file's points. All serving figures are
**simulated** unless a section says otherwise: the scheduler, block manager and baseline allocators run for
real; only step times come from the cost model (`jpaged/paper/sim/cost_model.py`), whose constants are fitted on
measurements of vLLM on A100 GPUs, never on the paper's figures (next section). Systems are built by
`jpaged/paper/systems.py`; every paper-figure config runs the paper's scheduler (`scheduler.policy: paper`).
Sustained rate = where normalized latency crosses 4× the sweep's lowest, interpolated (`+`: still under it at
the highest rate swept; `−`: over it at the lowest). Agreement sentences place each of our values against the
paper's range, value by value."""


def provenance(results: dict, figures: Figures) -> str:
    """Per result file: the runs that computed it, from its points' own provenance where they carry
    one (points kept by `--resume` keep theirs), else the file's (one run for the whole file)."""
    rows = ["| result | computed by (git sha, date: points) | device | jax |", "|---|---|---|---|"]
    for stem, r in sorted(results.items()):
        prov = r.get("provenance", {})
        stamps = [p["provenance"] for p in r.get("points", []) + r.get("rows", []) if "provenance" in p]
        runs = Counter((s.get("git_sha", "?")[:12], s.get("date", "?")[:10]) for s in stamps or [prov])
        who = ", ".join(f"`{sha}` {date}" + (f": {n}" if stamps else " (file)") for (sha, date), n in runs.items())
        real = r.get("real_provenance")  # preemption's real-executor rows, kept from an earlier run
        if real:
            who += f"; its real-executor rows: `{real.get('git_sha', '?')[:12]}` {real.get('date', '?')[:10]} on {real.get('device', '?')}"
        rows.append(f"| `{stem}.json` | {who} | {prov.get('device', '?')} | {prov.get('jax', prov.get('jax_version', '?'))} |")
    return ("## Provenance\n\n" + "\n".join(rows) + "\n\n(file): the file carries no per-point provenance; the sha "
            "and date are those of the run that wrote it, which, for a sweep written before points carried their own, "
            "may have kept points computed by earlier runs.")


# The report in order; kernel_bench opens Fig. 18 and block_size continues it (Fig. 18b).
SECTIONS = (header, sim_validation, figure_moves, memory_waste, throughput, real_executor, parallel_sampling,
            shared_prefix, chatbot, ablations, conversation, kernel_bench, block_size, preemption, chunked_prefill, fleet_section,
            spec_sim, spec_decode, host_and_real_engine, serving_against_vllm, startup, provenance)


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


def main() -> None:
    """The command line: `python -m experiments.report [--results DIR]` rewrites DIR/REPORT.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(REPO_ROOT / "results"), help="folder of the JSON results")
    print(write_report(Path(parser.parse_args().results)))
