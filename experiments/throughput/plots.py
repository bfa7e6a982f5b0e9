"""The figure of the throughput experiment: normalized latency (Fig. 12) and both batch sizes of
Fig. 13 against request rate, one line per system."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from experiments.plots import save, system_curves

# Fig. 13's two batch sizes (jpaged/paper/metrics.py BatchOccupancyAccumulator): point key, axis label.
BATCH_SIZES = (("requests_resident", "Requests resident in the KV cache"),
               ("requests_per_step", "Requests per step"))


def batch_size_panels(ax_resident, ax_per_step, points: list[dict], systems: list[str]) -> None:
    """Fig. 13 both ways, one panel each, on one y scale: requests holding KV blocks while a step
    runs, and requests with a token computed in the step (time-weighted averages over the run)."""
    for ax, (key, label) in zip((ax_resident, ax_per_step), BATCH_SIZES):
        system_curves(ax, points, key, systems, label)
    top = max(ax_resident.get_ylim()[1], ax_per_step.get_ylim()[1])
    for ax in (ax_resident, ax_per_step):
        ax.set_ylim(0, top)


def plot(path: Path, points: list[dict], config, threshold: float) -> Path:
    """Normalized latency (Fig. 12) and the two batch sizes of Fig. 13 against request rate, for
    the sweep's `config` (a ThroughputConfig) and its sustained-rate `threshold`."""
    fig, (ax_lat, ax_res, ax_step) = plt.subplots(1, 3, figsize=(13, 3.4))
    low = min(p["normalized_latency"] for p in points)
    system_curves(ax_lat, points, "normalized_latency", config.systems, "Normalized latency (s/token)",
                  ymax=max(10 * low, 1.5 * threshold))
    ax_lat.axhline(threshold, color="k", ls=":", lw=0.8, label="sustained threshold")
    ax_lat.legend(fontsize=7)
    batch_size_panels(ax_res, ax_step, points, config.systems)
    where = f"{config.sim.tp}x {config.sim.gpu}" if config.executor == "sim" else "real model (jax)"
    fig.suptitle(f"{config.model.name} on {where}, {config.dataset}, {config.duration_s:.0f} s traces", fontsize=9)
    fig.tight_layout()
    return save(fig, path)
