"""REPORT.md section for Fig. 16: a few-shot prefix shared through vLLM's prefix cache against Orca (Oracle)."""

from __future__ import annotations

import itertools

from experiments.markdown import Figures, command, finished, not_run, rate_cell


def shared_prefix(results: dict, figures: Figures) -> str:
    head = ("## Fig. 16 — shared prefix\n\nClaim: shared prefixes help (§6.4, Fig. 16); vLLM reaches 1.67× the throughput "
            "of Orca (Oracle) with a 1-shot prefix and 3.58× with 5-shot (§6.4, our reading).\n\n")
    r = finished(results, "shared_prefix", "sustained_rate")
    if r is None:
        return head + not_run("shared_prefix")
    lines, ratio = [], {}
    for n, by in r["sustained_rate"].items():
        c = r["sustained_rate_censored"][n]
        ratio[n] = by["vllm"] / by["orca_oracle"]
        hit = max(p.get("prefix_cache_hit_rate", 0.0) for p in r["points"] if str(p["prefix_len"]) == n)
        lines.append(f"| {n} | {rate_cell(by['vllm'], c['vllm'])} | {rate_cell(by['orca_oracle'], c['orca_oracle'])} | "
                     f"{by['vllm'] / by['orca_oracle']:.2f}× | {100 * hit:.0f}% |")
    cfg = r["provenance"]["config"]
    return head + f"""Command: {command("shared_prefix")} ({r['total_wall_s']:.0f} s). {cfg['model']['name']} on
{cfg['sim']['tp']}× {cfg['sim']['gpu']} ({cfg['executor']}), task inputs LogNormal(median {cfg['input_median']:.0f} tokens),
outputs {cfg['output_ratio']}× the input (an assumption for WMT16 En→De).

| prefix tokens | vLLM (req/s) | Orca Oracle (req/s) | ratio | vLLM prompt tokens from the cache |
|---|---|---|---|---|
{chr(10).join(lines)}

{figures(("shared_prefix.png", "Fig. 16: normalized latency vs request rate per shared prefix"))}

Agreement, per value: vLLM / Orca (Oracle) """ + "; ".join(
        f"{n}-token prefix {x:.2f}× (paper {PAPER_PREFIX.get(n, '?')}×)" for n, x in ratio.items()) + f"""; the longer
prefix gives {"the larger" if _grows(ratio) else "not the larger"} advantage (paper: the larger). """ + _moved(r, ratio) + """ Differences and
why: cache hits cost nothing from the step's token budget (a step admits more prompts than their length suggests),
and the simulator prices prefill by FLOPs, so skipping the prefix saves compute as well as the memory that lets vLLM
batch more requests."""


def _moved(r: dict, ratio: dict[str, float]) -> str:
    """What pre-storing the prefix changed against the cache that filled itself on use."""
    if not any(p.get("prefix_pinned") for p in r["points"]):
        return ("Our prefix cache fills itself from the first request rather than being pre-stored, so the first "
                "request pays the prefix, and the last partial prefix block (341 = 21 × 16 + 5 tokens) is recomputed "
                "by every request.")
    return ("The prefix is pre-stored before each trace as in the paper (§4.4, `LLMEngine.pin_prefix`: pinned, its "
            "last partial block, 341 = 21 × 16 + 5 tokens, shared copy-on-write), so no request computes any of it. "
            "Before pre-storing (the cache filled by the first request, the partial block recomputed by every "
            "request) the ratios were " + ", ".join(
                f"{BEFORE_PINNING[n]:.2f}× ({n}-token prefix, now {ratio[n]:.2f}×)" for n in ratio if n in BEFORE_PINNING)
            + ". Pre-storing barely moves them: it saves the first request's prefix (one prefill in thousands) and, "
            "for the 5-shot prefix, 5 recomputed tokens of the ~30 each request still computes (the 1-shot prefix, "
            "80 = 5 × 16, has no partial block). So the gap to the paper's ratios is not the prefix's recomputation; "
            "where it lies we have not measured.")


PAPER_PREFIX = {"80": 1.67, "341": 3.58}  # vLLM / Orca (Oracle), 1-shot and 5-shot (§6.4, our reading)
# vLLM / Orca (Oracle) with the cache filled on use: results/shared_prefix.json before pin_prefix (commit 3dd8d01).
BEFORE_PINNING = {"80": 1.33, "341": 2.48}


def _grows(ratio: dict[str, float]) -> bool:
    """Whether vLLM's advantage grows with the prefix length."""
    ordered = [ratio[n] for n in sorted(ratio, key=int)]
    return all(a < b for a, b in itertools.pairwise(ordered))
