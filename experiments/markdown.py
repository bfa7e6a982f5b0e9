"""What every section of results/REPORT.md shares: the paper it cites, the Orca variants, the
figures beside the report, experiment commands, and the phrases that place our numbers against the
paper's. A section is a function (every loaded result: file stem -> JSON, and the report's
`Figures`) -> markdown; numbers are read from the results, the prose says why they differ. Each
figure's section lives beside its experiment (experiments/<name>/report.py); the report's order is
experiments/report/document.py's. This module sits beside common.py, not in experiments/report/, so
the sections import it and the report imports the sections: one way (checked by
tests/experiments/test_experiments_layout.py)."""

from __future__ import annotations

from pathlib import Path

# The paper every claim cites; its sections and figures are named where a claim is quoted.
PAPER = ('Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", '
         "SOSP'23 (arXiv:2309.06180)")

ORCAS = ("orca_oracle", "orca_pow2", "orca_max")


class Figures:
    """Markdown for the figure PNGs in the report's folder: an embedded image where the file exists
    (its name relative to REPORT.md, so results/quick/REPORT.md shows results/quick's PNGs)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def __call__(self, *names_and_captions: tuple[str, str]) -> str:
        """One image line per existing (file name, caption); a note when none exists."""
        shown = [f"![{caption}]({name})" for name, caption in names_and_captions if (self.folder / name).exists()]
        return "\n\n".join(shown) if shown else "*No figure yet: the command above draws it.*"



def command(module: str, config: str | None = None) -> str:
    """The command line of the experiment `module` (under experiments/, e.g. "throughput" or
    "bench.bench_host"), as inline code; its config defaults to the module's last name."""
    return f"`python -m experiments.{module} --config configs/{config or module.rpartition('.')[2]}.yaml`"


def not_run(module: str, config: str | None = None) -> str:
    """What a section says when its result is missing: the command that makes it."""
    return f"*Not run yet: {command(module, config)}.*"



def against(values: dict[str, float], lo: float, hi: float, fmt: str = "{:.1f}") -> str:
    """Each labelled value placed against the paper's range [lo, hi], value by value (never a
    range against a range): "2 of 3 within 1.7–2.7 (a 1.8, b 2.1); below: c 1.3"."""
    inside = {k: v for k, v in values.items() if lo <= v <= hi}
    below = {k: v for k, v in values.items() if v < lo}
    above = {k: v for k, v in values.items() if v > hi}
    show = lambda d: ", ".join(f"{k} {fmt.format(v)}" for k, v in d.items())  # noqa: E731
    parts = [f"{len(inside)} of {len(values)} within {fmt.format(lo)}–{fmt.format(hi)}" + (f" ({show(inside)})" if inside else "")]
    parts += [f"below: {show(below)}"] * bool(below) + [f"above: {show(above)}"] * bool(above)
    return "; ".join(parts)


def finished(results: dict, stem: str, key: str) -> dict | None:
    """The result `stem` if its run finished (it has `key`; a sweep in progress holds only points)."""
    r = results.get(stem)
    return r if r is not None and key in r else None


def rate_cell(rate: float, censored: str | None) -> str:
    """A sustained rate, marked + (still under the threshold at the top of the sweep) or − (over it at the bottom)."""
    return f"{rate:.2f}" + {"above_sweep": "+", "below_sweep": "−"}.get(censored or "", "")

