"""REPORT.md section: the ablations of the four figures outside the paper's range (Figs. 12(c), 15, 16, 17).

Per figure: the table of `experiments.ablation` (the figure rerun with one modelling choice changed at a
time: each quantity the figure is judged by, its change from the baseline row of the same grid, and why
the choice is plausible or which source fixes it), then a verdict computed from the rows: whether any
row reaches the paper's range, how far the source-backed rows move it, and what the paper's number
would need. Fig. 16's verdict also reads the step measurement (`experiments.shared_prefix.steps`).
"""

from __future__ import annotations

import json

import yaml

from experiments.ablation import READINGS
from experiments.ablation.verdicts import VERDICTS, listed
from experiments.common import REPO_ROOT
from experiments.markdown import Figures, command, finished
from jpaged.paper.systems import LABELS

# (ablation stem, heading, the committed figure's stem, the quantity its verdict is about)
ABLATIONS = (
    ("ablation_throughput_opt175b_sharegpt", "Fig. 12(c): OPT-175B, ShareGPT, vLLM / Orca (Oracle)",
     "throughput_opt175b_sharegpt", "vLLM / Orca (Oracle)"),
    ("ablation_parallel_sampling", "Fig. 15: Alpaca beam search, width 6 saving", "parallel_sampling",
     "alpaca beam_recorded width 6 saving (%)"),
    ("ablation_shared_prefix", "Fig. 16: shared prefix, vLLM / Orca (Oracle)", "shared_prefix",
     "341-token prefix: vLLM / Orca (Oracle)"),
    ("ablation_chatbot", "Fig. 17: chatbot, vLLM / each Orca", "chatbot", "vLLM / Orca (Oracle)"),
)


def committed_quantities(stem: str, r: dict) -> dict[str, float]:
    """The quantities of the committed figure `stem` (its own sweep and thresholds), named as the
    ablation names them."""
    if stem == "parallel_sampling":
        return {f"{d} {x} width {w} saving (%)": v for d, xs in r["memory_saving"].items()
                for x, by in xs.items() for w, v in by.items()}
    panels = r["sustained_rate"] if stem == "shared_prefix" else {"": r["sustained_rate"]}
    out = {}
    for n, rates in panels.items():
        label = f"{n}-token prefix: " if n else ""
        for system, rate in rates.items():
            out[f"{label}{LABELS[system]} sustained (req/s)"] = rate
            if system != "vllm":
                out[f"{label}vLLM / {LABELS[system]}"] = rates["vllm"] / rate
    return out


def _fmt(quantity: str, value: float) -> str:
    """A saving in %, a ratio with ×, anything else (rates, counts) plain."""
    if quantity.endswith("(%)"):
        return f"{value:.1f}%"
    return f"{value:.2f}×" if " / " in quantity else f"{value:.2f}"


def _cell(quantity: str, value: float | None, base: float | None, paper: list[float] | None, flag: str = "") -> str:
    if value is None:
        return "—"
    text = _fmt(quantity, value) + {"above_sweep": "+", "below_sweep": "−"}.get(flag, "?" if flag else "")
    if paper and paper[0] <= value <= paper[1]:
        text = f"**{text}**"
    if base:
        text += f" ({100 * (value / base - 1):+.0f}%)"
    return text


def twin(a: dict, row: dict) -> dict:
    """The row `row`'s change is measured against: its `compare_with` row (a check's twin), else the baseline."""
    name = row.get("compare_with", "baseline")
    return next((r for r in a["rows"] if r["name"] == name), a["rows"][0])


def table(a: dict, committed: dict[str, float] | None) -> str:
    """The ablation's rows: the committed figure, the baseline of the ablation's grid, each variant."""
    paper = a["paper"]
    quantities = (list(paper) + a.get("columns", [])) or list(a["rows"][0]["quantities"])
    head = ("| row | reading | " + " | ".join(quantities) + " | why (source or bound) |\n|---|---|"
            + "---|" * len(quantities) + "---|")
    lines = [head]
    if committed is not None:
        lines.append("| the committed figure | — | " + " | ".join(
            _cell(q, committed.get(q), None, paper.get(q)) for q in quantities) + " | its own config and grid |")
    lines.append("| paper | — | " + " | ".join(
        (f"{_fmt(q, paper[q][0])}–{_fmt(q, paper[q][1])}" if q in paper else "—") for q in quantities) + " | |")
    for row in a["rows"]:
        changed = "".join(f"`{k}: {v}`, " for k, v in row["set"].items())
        only = f" ({', '.join(row['systems'])} only)" if row.get("systems") else ""
        against = twin(a, row)
        if against is not a["rows"][0]:
            only += f" (change vs {against['name']})"
        cells = " | ".join(_cell(q, row["quantities"].get(q), None if row is a["rows"][0] else against["quantities"].get(q),
                                 paper.get(q), row.get("censored", {}).get(q, "")) for q in quantities)
        why = row["why"].replace("|", "/")
        lines.append(f"| {row['name']}{only} | {row['reading']} | {cells} | {changed}{why} |")
    return "\n".join(lines)


def moves(a: dict, quantity: str) -> tuple[list[tuple[str, float]], list[str], list[tuple[str, float]]]:
    """(every modelling choice's change of `quantity` from the baseline, largest first; the rows inside
    the paper's range; the source-backed rows' changes). Check rows (`checks`) are not modelling choices."""
    base = a["rows"][0]["quantities"][quantity]
    lo, hi = a["paper"][quantity]
    choices = [row for row in a["rows"][1:] if row["reading"] != "check"]
    changes = sorted(((row["name"], row["quantities"][quantity] / base - 1) for row in choices
                      if quantity in row["quantities"]), key=lambda c: -abs(c[1]))
    inside = [row["name"] for row in [a["rows"][0], *choices] if lo <= row["quantities"].get(quantity, -1) <= hi]
    source = [(row["name"], row["quantities"][quantity] / base - 1) for row in choices if row["reading"] == "source"]
    return changes, inside, source


def checks(a: dict, quantity: str) -> list[tuple[str, str, float, float]]:
    """(check row, its twin, the check's value of `quantity`, its change from the twin's) per check row."""
    out = []
    for row in a["rows"]:
        if row["reading"] == "check" and quantity in row["quantities"]:
            other = twin(a, row)
            value = row["quantities"][quantity]
            out.append((row["name"], other["name"], value, value / other["quantities"][quantity] - 1))
    return out


def verdict(a: dict, quantity: str, committed: dict[str, float] | None) -> str:
    """The data half of a figure's verdict: in or out of the paper's range, by which rows, how far."""
    changes, inside, source = moves(a, quantity)
    base = a["rows"][0]["quantities"][quantity]
    lo, hi = a["paper"][quantity]
    now = "" if committed is None or quantity not in committed else f"the committed figure {_fmt(quantity, committed[quantity])}, "
    top = ", ".join(f"{name} {100 * c:+.0f}%" for name, c in changes[:3])
    src = ("; the source-backed rows: " + ", ".join(f"{name} {100 * c:+.0f}%" for name, c in source)) if source else ""
    status = (f"in the paper's range ({_fmt(quantity, lo)}–{_fmt(quantity, hi)}) in: {', '.join(inside)}" if inside
              else f"no row reaches the paper's range ({_fmt(quantity, lo)}–{_fmt(quantity, hi)})")
    check = "".join(f" Check: {name} gives {_fmt(quantity, value)}, {100 * c:+.1f}% from {other}." for name, other, value, c
                    in checks(a, quantity))
    return (f"{quantity}: {now}the ablation's baseline {_fmt(quantity, base)}; {status}. Largest moves: {top}{src}.{check}")


def summary(results: dict) -> str:
    """One line per ablated figure: the paper's number, the committed figure's, the source-backed rows'
    moves, the rows inside the paper's range, and whether the committed figure is in range."""
    lines = ["| figure | quantity | paper | committed figure | source-backed rows | rows in the paper's range | committed figure in range |",
             "|---|---|---|---|---|---|---|"]
    largest_source = 0.0
    for stem, heading, figure, _ in ABLATIONS:
        a = finished(results, stem, "rows")
        fig = results.get(figure)
        if a is None:
            continue
        for quantity, (lo, hi) in a["paper"].items():
            committed = committed_quantities(figure, fig).get(quantity) if fig and (
                "sustained_rate" in fig or "memory_saving" in fig) else None
            _, inside, source = moves(a, quantity)
            largest_source = max([largest_source, *(abs(c) for _, c in source)])
            lines.append(f"| {heading.split(':')[0]} | {quantity} | {_fmt(quantity, lo)}–{_fmt(quantity, hi)} | "
                         f"{'—' if committed is None else _fmt(quantity, committed)} | "
                         + (", ".join(f"{n} {100 * c:+.0f}%" for n, c in source) or "none") + " | "
                         + listed(inside, [r["name"] for r in a["rows"] if r["reading"] != "check"]) + " | "
                         + ("—" if committed is None else ("yes" if lo <= committed <= hi else "no")) + " |")
    opening = (f"The source-backed rows move no quantity by more than {100 * largest_source:.1f}%, so the committed "
               f"configs keep their values and every committed number stands; per figure:" if largest_source < 0.01 else
               f"A source-backed row moves a quantity by up to {100 * largest_source:.0f}%: see the figure's table; "
               f"per figure:")
    return opening + "\n\n" + "\n".join(lines)


def _figure_verdict(stem: str, a: dict, results: dict) -> str:
    """The figure-specific half of the verdict, which reads every row: only when every variant ran."""
    readings = a.get("provenance", {}).get("config", {}).get("readings", list(READINGS))
    if set(readings) != set(READINGS):
        return (f"Only the {' and '.join(readings)} rows ran here (`readings`); the run with every row gives the "
                f"rest of the verdict.")
    return VERDICTS[stem](a, results)


def point_commits(a: dict) -> str:
    """Which commits computed the rows' points ("`sha` date on cpu: n points", one per commit, date and CPU), read from
    each row's own result file; a row kept from the baseline (read-only rows) adds none."""
    counts: dict[tuple[str, str], int] = {}
    for row in a["rows"]:
        path = REPO_ROOT / row["result"] if row.get("result") else None
        if path is None or not path.is_file():
            continue
        for point in json.loads(path.read_text()).get("points", []):
            prov = point.get("provenance", {})
            key = (prov.get("git_sha", "?")[:12] + ("+dirty" if prov.get("git_sha", "").endswith("+dirty") else ""),
                   prov.get("date", "?")[:10], prov.get("cpu", "?"))
            counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"`{sha}` {date} on {cpu}: {n}" for (sha, date, cpu), n in sorted(counts.items(), key=lambda kv: kv[0][1])) or "none"


def ablations(results: dict, figures: Figures) -> str:
    """The section: one table and verdict per ablated figure."""
    out = ["""## Ablations of the four figures outside the paper's range

Each figure below is rerun with one modelling choice changed at a time
(`python -m experiments.ablation --config configs/ablation/<figure>.yaml`; each row is the figure's own run, its
points in `results/ablation/*/*.json`, one file per row). The baseline row is the figure's committed config on the
ablation's grid (its changes and trace length stated per table; a trace shorter than the figure's has check rows
on the figure's own), so each row's change (in parentheses) is against a baseline of the same grid; the
committed figure's own value is the first row. **Bold**: inside the paper's range (our reading of the paper's
number, as its section states it; a single printed number is read ±10%). `+`: a sustained rate past the top of
the row's grid (the ratio is a bound). *source*: the row's value is fixed by the paper, its artifact or vLLM
v0.1.x (the citation is in the last column); *bound*: a plausible bound of a choice no source fixes; *check*: a
check of the ablation's method, not a modelling choice (the same row on another trace length; its change is
against the row it repeats). Rows with `only` rerun those systems alone and keep the baseline's points of the
others."""]
    out.append(summary(results))
    for stem, heading, figure, quantity in ABLATIONS:
        a = finished(results, stem, "rows")
        name = stem.removeprefix("ablation_")
        if a is None:
            out.append(f"### {heading}\n\n*Not run yet: {command('ablation', f'ablation/{name}')}.*")
            continue
        fig = results.get(figure)
        committed = committed_quantities(figure, fig) if fig and ("sustained_rate" in fig or "memory_saving" in fig) else None
        common = ", ".join(f"`{k}`" for k in a["common"]) or "nothing"
        wall = sum(row["wall_s"] for row in a["rows"])
        own = yaml.safe_load((REPO_ROOT / a["base"]).read_text())["duration_s"]
        trace = a["common"].get("duration_s", own)
        where = "the figure's own" if trace == own else f"the figure: {own:g} s"
        out.append(f"### {heading}\n\nCommand: {command('ablation', f'ablation/{name}')} ({wall:.0f} s); base "
                   f"`{a['base']}`, the grid changing {common}; {trace:g} s traces "
                   f"({where}); points computed by {point_commits(a)}."
                   f"\n\n{table(a, committed)}\n\n"
                   f"Verdict. {verdict(a, quantity, committed)} {_figure_verdict(stem, a, results)}")
    return "\n\n".join(out)
