"""The figures of the memory waste experiment (Fig. 2): the KV space's states per system as
stacked bars, and the block pool over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from experiments.plots import save
from jpaged.paper.systems import LABELS

# Fig. 2's states, bottom to top, with their colors.
KV_STATES = (("token_states", "Token states", "tab:green"), ("reserved", "Reserved", "tab:orange"),
             ("internal", "Internal frag.", "tab:red"), ("external", "External frag.", "tab:purple"),
             ("free", "Free", "whitesmoke"))


def stacked_breakdown(path: str | Path, windows: dict[str, dict[str, dict[str, float]]], title: str) -> Path:
    """Fig. 2: per system, one stacked bar of the KV space's states (percent) per averaging window.

    `windows`: window label (e.g. "whole run", "steady state") -> system -> state -> percent; a
    system missing from a window (its pool never filled) gets no bar there.
    """
    systems = list(next(iter(windows.values())))
    width = 0.8 / len(windows)
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(systems), 3.8))
    for w, (window, breakdown) in enumerate(windows.items()):
        x = np.arange(len(systems)) + (w - (len(windows) - 1) / 2) * width
        bottom = np.zeros(len(systems))
        shown = np.array([s in breakdown for s in systems])
        for key, label, color in KV_STATES:
            values = np.array([breakdown.get(s, {}).get(key, 0.0) for s in systems])
            ax.bar(x[shown], values[shown], width=width * 0.95, bottom=bottom[shown], color=color, edgecolor="k",
                   lw=0.4, hatch=".." if w else None, label=label if w == 0 else None)
            for xi, v, b in zip(x[shown], values[shown], bottom[shown]):
                if v >= 6:
                    ax.text(xi, b + v / 2, f"{v:.1f}", ha="center", va="center", fontsize=6)
            bottom += values
        for xi in x[shown]:
            ax.text(xi, 101, window, ha="center", va="bottom", fontsize=5.5, rotation=90)
    ax.set_xticks(range(len(systems)), [LABELS[s] for s in systems], rotation=15, fontsize=8)
    ax.set_ylabel("KV cache space (%)")
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save(fig, path)


def pool_pictures(path: str | Path, pictures: dict[str, tuple[np.ndarray, np.ndarray, float]], title: str) -> Path:
    """The block pool over time, one panel per system: color = owning request, pale = reserved but
    not yet written, white = free. `pictures[system]` = (owner i64[T, N], written bool[T, N],
    seconds between snapshots); owner -1 is free."""
    fig, axes = plt.subplots(1, len(pictures), figsize=(4.2 * len(pictures), 3.6), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (system, (owner, written, dt)) in zip(axes[0], pictures.items()):
        rgb = np.asarray(cmap(owner % 20))[..., :3]
        rgb = np.where(written[..., None], rgb, 0.35 * rgb + 0.65)  # reserved, unwritten: pale
        rgb[owner < 0] = 1.0
        ax.imshow(rgb.transpose(1, 0, 2), aspect="auto", origin="lower", interpolation="nearest",
                  extent=(0, owner.shape[0] * dt, 0.5, owner.shape[1] + 0.5))
        ax.set_title(LABELS[system], fontsize=9)
        ax.set_xlabel("Time (s)")
        ax.set_ylabel("Block id")
    fig.suptitle(title, fontsize=9)
    return save(fig, path)
