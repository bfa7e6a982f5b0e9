"""The fleet figure: per deployment (a row), sustained rate vs replicas for each workload, one line
per routing policy beside R x the one-replica rate, and the fleet's prefix-hit rate vs replicas."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from experiments.plots import save

COLORS = {"round_robin": "tab:blue", "cache_aware": "tab:red"}
LABELS = {"round_robin": "round-robin", "cache_aware": "cache-aware (sglang rule)"}
TITLES = {"shared_prefix": "shared prefixes", "multi_turn": "multi-turn"}


def plot(path: Path, result: dict, config) -> Path:
    """Draws `result` (experiments.fleet's JSON) for `config` (a FleetConfig) into `path`: per
    deployment a row of sustained-rate panels (one per workload), then hit-rate panels (one per
    workload: at the sustained rate, solid; at the lowest rate swept, dashed)."""
    workloads, replicas = config.workloads, sorted(config.replicas)
    rows, cols = len(config.deployments), 2 * len(workloads)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.1 * rows), squeeze=False)
    for row, d in zip(axes, config.deployments):
        by_workload = result["sustained"][d.name]
        for ax, workload in zip(row, workloads):
            curves = by_workload[workload]
            one = min(curves[p][str(replicas[0])]["rate"] for p in config.policies) / replicas[0]
            ax.plot(replicas, [r * one for r in replicas], color="0.6", ls=":", label="R x one replica")
            for policy in config.policies:
                ax.plot(replicas, [curves[policy][str(r)]["rate"] for r in replicas], marker="o", ms=4,
                        color=COLORS[policy], label=LABELS[policy])
            _axes(ax, f"{d.name}: {TITLES[workload]}", "Sustained rate (req/s)", replicas)
        for ax, workload in zip(row[len(workloads):], workloads):
            curves = by_workload[workload]
            for policy in config.policies:
                for key, ls, where in (("prefix_hit_rate", "-", "at the sustained rate"),
                                       ("light_load_hit_rate", "--", "at the lowest rate")):
                    ax.plot(replicas, [100 * curves[policy][str(r)][key] for r in replicas], marker="o", ms=3,
                            color=COLORS[policy], ls=ls, label=f"{LABELS[policy]}, {where}")
            _axes(ax, f"{d.name}: {TITLES[workload]}, cache hits", "Prompt tokens from the cache (%)", replicas)
            ax.set_ylim(0, 100)
    axes[0][0].legend(fontsize=7)
    axes[0][len(workloads)].legend(fontsize=6)
    fig.suptitle("Simulated fleets behind a router (step times: the cost model fitted on Vidur's A100 data)", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def _axes(ax, title: str, ylabel: str, replicas: list[int]) -> None:
    """Title, labels, a log2 x axis ticked at the replica counts, a grid."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("Replicas R")
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.set_xticks(replicas, [str(r) for r in replicas])
    ax.grid(alpha=0.3)
