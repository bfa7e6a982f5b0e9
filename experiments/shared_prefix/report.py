"""REPORT.md section for Fig. 16: a few-shot prefix shared through vLLM's prefix cache against Orca (Oracle)."""

from __future__ import annotations

import itertools

from experiments.markdown import Figures, command, finished, not_run, rate_cell
from jpaged.paper.systems import LABELS


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
batch more requests.""" + _steps(results, r)


def _steps(results: dict, figure: dict) -> str:
    """The step measurement at the sustained rates and at the rate the paper's ratio needs."""
    r = finished(results, "shared_prefix_steps", "points")
    if r is None:
        return "\n\n*Steps not measured yet: " + command("shared_prefix.steps", "shared_prefix_steps") + ".*"
    rows = []
    for p in r["points"]:
        st, pr, de = p["steps"], p["steps"]["prompt"], p["steps"]["decode"]
        parts = {k: pr["ms_per_request"][k] + de["ms_per_request"][k] for k in pr["ms_per_request"]}
        threshold = figure["latency_threshold"][str(p["prefix_len"])]
        role = "its sustained rate" if p["role"] == "sustained" else "the paper's ratio × Orca's rate"
        rows.append(f"| {p['prefix_len']} | {LABELS[p['system']]} at {role} | {p['request_rate']:.1f} | "
                    f"{p['normalized_latency'] / threshold:.2f} | {st['busy_ms_per_request']:.1f} / {1e3 / p['request_rate']:.1f} | "
                    f"{100 * pr['time_share']:.0f}% | {pr['mean_seqs']:.1f} / {pr['mean_tokens']:.0f} | "
                    f"{st['prompt_tokens_per_request']:.0f} | {de['mean_seqs']:.0f} | {100 * de['kv_held_fraction']:.0f}% | "
                    f"{pr['gemm_over_floor']:.1f} / {de['gemm_over_floor']:.1f} | "
                    f"{parts['gemm']:.1f} / {parts['attention']:.1f} / {parts['host']:.1f} |")
    by = {(p["prefix_len"], p["system"], p["role"]): p for p in r["points"]}
    sentences = []
    for n, ratio in r["paper_ratio"].items():
        o, v, need = (by.get((int(n), s, role)) for s, role in (("orca_oracle", "sustained"), ("vllm", "sustained"),
                                                                ("vllm", "paper_ratio")))
        if None in (o, v, need):
            continue
        threshold = figure["latency_threshold"][n]
        sentences.append(
            f"{n}-token prefix: at its sustained rate Orca (Oracle) holds {100 * o['steps']['decode']['kv_held_fraction']:.0f}% "
            f"of the KV pool ({o['steps']['decode']['mean_seqs']:.0f} sequences per decode step) and computes "
            f"{o['steps']['prompt_tokens_per_request']:.0f} prompt tokens per request; vLLM holds "
            f"{100 * v['steps']['decode']['kv_held_fraction']:.0f}% ({v['steps']['decode']['mean_seqs']:.0f} sequences) and "
            f"computes {v['steps']['prompt_tokens_per_request']:.0f}. Both are busy the whole time (step time per request "
            f"≈ 1 / rate): Orca is bound by memory, vLLM by step time, not memory. The paper's {ratio}× needs vLLM at "
            f"{need['request_rate']:.1f} req/s, i.e. at most {1e3 / need['request_rate']:.1f} ms of steps per request; there it "
            f"takes {need['steps']['busy_ms_per_request']:.1f} ms (batches of {need['steps']['decode']['mean_seqs']:.0f} "
            f"sequences, {100 * need['steps']['decode']['kv_held_fraction']:.0f}% of the pool), so it still keeps up, but its "
            f"normalized latency is {need['normalized_latency'] / threshold:.2f}× the sustained threshold: the larger "
            f"batches' longer steps (host work and KV reads per sequence) push per-token latency over the line before "
            f"throughput runs out.")
    return f"""

What the steps show (`python -m experiments.shared_prefix.steps --config configs/shared_prefix_steps.yaml`,
`shared_prefix_steps.json`, {r['provenance']['config']['duration_s']:.0f} s traces): each system at its sustained rate above and vLLM at the
rate the paper's ratio would need. Per point: normalized latency over the sustained threshold; step seconds per
request (busy time / completed requests) against 1 / rate; the share of time in prompt steps, their sequences and
tokens; prompt tokens computed per request; sequences per decode step; KV blocks held (decode steps,
time-weighted); GEMM time over its one-token weight-read floor (≈ 1: memory-bound; ≫ 1: compute-bound), prompt /
decode steps; and ms per request in GEMMs / attention / host work.

| prefix | system, rate | req/s | latency / threshold | ms per request / 1 / rate | prompt steps' time | prompt step seqs / tokens | prompt tokens per request | decode seqs | KV held | GEMM / floor | ms: GEMM / attention / host |
|---|---|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

""" + " ".join(sentences)


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
            "the step measurement below shows where it lies.")


PAPER_PREFIX = {"80": 1.67, "341": 3.58}  # vLLM / Orca (Oracle), 1-shot and 5-shot (§6.4, our reading)
# vLLM / Orca (Oracle) with the cache filled on use: results/shared_prefix.json before pin_prefix (commit 3dd8d01).
BEFORE_PINNING = {"80": 1.33, "341": 2.48}


def _grows(ratio: dict[str, float]) -> bool:
    """Whether vLLM's advantage grows with the prefix length."""
    ordered = [ratio[n] for n in sorted(ratio, key=int)]
    return all(a < b for a, b in itertools.pairwise(ordered))
