"""The figure-specific half of each ablation's verdict (experiments/ablation/report.py writes the
data half): what the rows say about the cause, and what the paper's number would need. Each
function reads its ablation's rows (and, for Fig. 16, the step measurement) and returns prose whose
numbers all come from those files."""

from __future__ import annotations


def _q(a: dict, row: str, quantity: str) -> float | None:
    """`quantity` of the row named `row`, or None where that row did not run."""
    return next((r["quantities"].get(quantity) for r in a["rows"] if r["name"] == row), None)


def fig12c(a: dict, results: dict) -> str:
    return ""


def fig15(a: dict, results: dict) -> str:
    return ""


def fig16(a: dict, results: dict) -> str:
    return ""


def fig17(a: dict, results: dict) -> str:
    return ""


VERDICTS = {"ablation_throughput_opt175b_sharegpt": fig12c, "ablation_parallel_sampling": fig15,
            "ablation_shared_prefix": fig16, "ablation_chatbot": fig17}
