"""REPORT.md section on which paper figures moved when the simulator and the scheduler changed
(results/figure_moves.json, written by experiments/report/figure_moves.py)."""

from __future__ import annotations

from experiments.markdown import Figures, command, not_run


def _span(values) -> str:
    values = list(values)
    return f"{min(values):.2f}–{max(values):.2f}"


def _cell(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"


def _change(before: float | None, after: float | None) -> str:
    if before is None or after is None or before == 0:
        return ""
    return f"{100 * (after / before - 1):+.0f}%"


# Why each figure moved, by the quantity's prefix; the numbers sit in the table above the list.
WHY = (
    ("Fig. 2", "slower steps change how long requests live, not how the allocators place them: the shares barely move"),
    ("Fig. 12", "the cost model: vLLM's measured host work (0.17–0.30 ms per sequence per step) and achieved "
                "bandwidth make large batches expensive, so vLLM's and the Orca variants' knees move to lower rates, "
                "most where memory admits large batches (OPT-175B, Alpaca); FasterTransformer moves either way: "
                "it no longer pays vLLM's Python host time, while its GPU steps got slower like everyone's"),
    ("Fig. 13", "the definition: the previous figure plotted requests per step only; both counts are now reported, "
                "at the paper's rates"),
    ("Fig. 14", "the scheduler, then the cost model: the sequence budget now counts a group at its width n "
                "(a fresh group used to count 1 and fork past the cap), so at most 256 / n groups run at once; at "
                "width 6 that cap binds before vLLM's memory does and lowers its rate (previous → attribution), "
                "then the cost model lowers every rate as in Fig. 12"),
    ("Fig. 15", "the saving rate on ShareGPT (now 0.25 req/s, below every width's knee, where it was 0.5) and, for "
                "the recorded series, a trained model's branching instead of seeded draws"),
    ("Fig. 16", "the cost model; the scheduler's change here (prefix-cache hits no longer count against the step's "
                "token budget) barely matters, since prompts this short seldom fill a 2048-token budget"),
    ("Fig. 17", "the cost model"),
    ("Fig. 18b", "the rates (just below vLLM's new knee) and the cost model"),
    ("Fig. 19b", "the cost model"),
    ("chunked", "nothing: the previous file was computed by the same code (at a dirty tree), today's at a clean commit"),
)


def _per_system(rows: list[dict], prefix: str) -> str:
    """Previous -> now per system over a figure's sustained rates (every panel of Fig. 12)."""
    out = []
    for label in ("vLLM", "Orca (Oracle)", "Orca (Pow2)", "Orca (Max)", "FasterTransformer"):
        ch = [r["after"] / r["before"] - 1 for r in rows if r["quantity"].startswith(prefix)
              and f" {label} sustained" in r["quantity"] and r["before"] and r["after"] is not None]
        if ch:
            out.append(f"{label} {100 * min(ch):+.0f}% to {100 * max(ch):+.0f}%")
    return f" Previous → now per system over its panels: {'; '.join(out)}." if out else ""


def _split(rows: list[dict], prefix: str) -> str:
    """For one figure: how far the attribution run is from the previous results (the scheduler's part)
    and today's from the attribution (the cost model's), over the quantities all three have."""
    both = [r for r in rows if r["quantity"].startswith(prefix) and None not in (r["before"], r["attribution"], r["after"])
            and r["before"] and r["attribution"]]
    if not both:
        return ""
    sched = [r["attribution"] / r["before"] - 1 for r in both]
    cost = [r["after"] / r["attribution"] - 1 for r in both]
    return (f" Over its {len(both)} quantities with an attribution run: previous → attribution (the scheduler) "
            f"{100 * min(sched):+.0f}% to {100 * max(sched):+.0f}%; attribution → now (the cost model and grids) "
            f"{100 * min(cost):+.0f}% to {100 * max(cost):+.0f}%.")


def figure_moves(results: dict, figures: Figures) -> str:
    head = "## Which figures moved and why\n\n"
    r = results.get("figure_moves")
    if r is None:
        return head + not_run("report.figure_moves")
    sha = r["before"]["rev"][:12]
    has_attr = any(row["attribution"] is not None for row in r["rows"])
    rows = ["| quantity | before | " + ("attribution | " if has_attr else "") + "now | change |",
            "|---|---|" + ("---|" if has_attr else "") + "---|---|"]
    for row in r["rows"]:
        cells = [row["quantity"], _cell(row["before"])] + ([_cell(row["attribution"])] if has_attr else [])
        rows.append("| " + " | ".join(cells + [_cell(row["after"]), _change(row["before"], row["after"])]) + " |")
    agreement = r["old_cost_model"]["rows"]
    decode = [a["ratio"] for a in agreement if a["kind"] == "decode" and a["batch"] <= 32]
    allr = [a["ratio"] for a in agreement]
    slower = "; ".join(
        f"{m}: decode {_span(a['fitted_ratio'] for a in agreement if a['model'] == m and a['kind'] == 'decode' and a['batch'] <= 32)}× "
        f"at batch 1–32, {_span(a['fitted_ratio'] for a in agreement if a['model'] == m and a['kind'] == 'decode' and a['batch'] > 32)}× "
        f"at 128–256, prompts {_span(a['fitted_ratio'] for a in agreement if a['model'] == m and a['kind'] == 'prompt')}×"
        for m in dict.fromkeys(a["model"] for a in agreement))
    moved = [row for row in r["rows"] if row["before"] and row["after"] and abs(row["after"] / row["before"] - 1) > 0.1]
    why = "\n".join(f"- {fig}: {text}.{_per_system(r['rows'], fig) if fig == 'Fig. 12' else ''}{_split(r['rows'], fig)}"
                    for fig, text in WHY)
    return head + f"""Before = the committed results at `{sha}` (main when this phase began: the pre-fit cost model and, except
`chunked_prefill.json`, the scheduler before issue 13's redesign); now = the files beside this report. Attribution
(where present) = today's code and scheduler with the pre-fit cost model, on the previous results' rate grids
(`configs/attribution/*.yaml`): before → attribution is what the scheduler changed, attribution → now what the
cost model (and the new grids) changed. The attribution's cost model reproduces the pre-fit model's step times
to within {100 * (max(abs(x - 1) for x in decode)):.1f}% on decode batches up to 32 and {min(allr):.3f}–{max(allr):.3f}× on
every checked batch and prompt (its code loaded from `{r['old_cost_model']['rev']}`). Today's fitted model's step
times over the pre-fit model's: {slower}. Written by
{command("report.figure_moves")}; {len(moved)} of {len(r['rows'])} quantities moved by more than 10%.

{chr(10).join(rows)}

Why:
{why}"""
