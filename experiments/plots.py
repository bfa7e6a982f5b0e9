"""Plotting helpers shared by the figure experiments: one color and marker per system, one curve per
system against request rate, headless PNG output. A figure's own drawing lives in its package
(experiments/<name>/plots.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: experiments write PNGs, they never open windows

import matplotlib.pyplot as plt  # noqa: E402

from jpaged.paper.systems import LABELS  # noqa: E402

# The paper's figures draw vLLM in red and the baselines in cooler colors.
COLORS = {"vllm": "tab:red", "orca_oracle": "tab:blue", "orca_pow2": "tab:cyan",
          "orca_max": "tab:purple", "fastertransformer": "tab:gray"}
MARKERS = {"vllm": "o", "orca_oracle": "s", "orca_pow2": "^", "orca_max": "v", "fastertransformer": "x"}


def save(fig, path: str | Path, dpi: int = 130) -> Path:
    """Writes `fig` as a PNG at `dpi` (creating the folder) and closes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def system_curves(ax, points: list[dict], key: str, systems: list[str], ylabel: str,
                  ymax: float | None = None) -> None:
    """One line per system of `key` against request rate, from sweep points."""
    for system in systems:
        pts = sorted((p["request_rate"], p[key]) for p in points if p["system"] == system)
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker=MARKERS[system], color=COLORS[system], label=LABELS[system], ms=4)
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(ylabel)
    if ymax is not None:
        ax.set_ylim(0, ymax)
    ax.grid(alpha=0.3)
