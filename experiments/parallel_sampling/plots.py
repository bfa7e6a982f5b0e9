"""The figures of the parallel sampling experiment: Fig. 14 (latency per series and width) and
Fig. 15 (memory saving per series and width)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from experiments.plots import save, system_curves

# Legend and panel titles of the series (parallel sampling; beam search under each branching model).
SERIES_LABELS = {"parallel": "Parallel sampling", "beam_synthetic": "Beam search (synthetic branching)",
                 "beam_recorded": "Beam search (recorded branching)"}
SERIES_TITLES = {"parallel": "parallel n", "beam_synthetic": "beam (synthetic) width",
                 "beam_recorded": "beam (recorded) width"}


def latency(path, points: list[dict], config, series: list[str], dataset: str) -> None:
    """Fig. 14: normalized latency vs request rate, one panel per (series, width)."""
    fig, axes = plt.subplots(len(series), len(config.widths), figsize=(3.2 * len(config.widths), 2.8 * len(series)),
                             squeeze=False)
    for i, name in enumerate(series):
        for j, width in enumerate(config.widths):
            panel = [p for p in points if (p["dataset"], p["series"], p["width"]) == (dataset, name, width)]
            low = min(p["normalized_latency"] for p in panel)
            system_curves(axes[i][j], panel, "normalized_latency", config.systems,
                                "Normalized latency (s/token)", ymax=8 * low * config.latency_threshold_factor / 4)
            axes[i][j].set_title(f"{SERIES_TITLES[name]} = {width}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{config.model.name}, {config.sim.tp}x {config.sim.gpu}, {dataset}, "
                 f"{config.duration_s:.0f} s traces (simulated)", fontsize=9)
    fig.tight_layout()
    save(fig, path)


def saving(path, saving_by_dataset: dict, widths: list[int]) -> None:
    """Fig. 15: memory saving (%) per width for every series, one panel per dataset."""
    fig, axes = plt.subplots(1, len(saving_by_dataset), figsize=(4.4 * len(saving_by_dataset), 3.2), squeeze=False)
    for ax, (dataset, by_series) in zip(axes[0], saving_by_dataset.items()):
        bar = 0.8 / len(by_series)
        for k, (name, by_width) in enumerate(by_series.items()):
            x = np.arange(len(widths)) + bar * k
            values = [by_width[str(w)] for w in widths]
            ax.bar(x, values, width=bar, label=SERIES_LABELS[name])
            for xi, v in zip(x, values):
                ax.text(xi, v + 0.5, f"{v:.1f}", ha="center", fontsize=6)
        ax.set_xticks(np.arange(len(widths)) + bar * (len(by_series) - 1) / 2, [str(w) for w in widths])
        ax.set_xlabel("# output sequences (n or beam width)")
        ax.set_ylabel("Memory saving (%)")
        ax.set_ylim(0, 100)
        ax.set_title(dataset, fontsize=9)
        ax.legend(fontsize=6, loc="upper left")
    save(fig, path)
