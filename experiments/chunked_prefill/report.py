"""REPORT.md section beyond the paper: the paper's scheduler against chunked prefill (TTFT, ITL, TPOT,
sustained rate and capacity under an ITL SLO)."""

from __future__ import annotations

from experiments.markdown import Figures, command, finished, not_run, rate_cell


def _crossing(points: list[dict], key: str, threshold: float) -> tuple[float, str | None]:
    """The rate where `key` first exceeds `threshold` (linear interpolation), as sustained_rates does."""
    pts = sorted((p["request_rate"], p[key]) for p in points)
    over = next((k for k, (_, v) in enumerate(pts) if v > threshold), None)
    if over is None:
        return pts[-1][0], "above_sweep"
    if over == 0:
        return pts[0][0], "below_sweep"
    (r0, v0), (r1, v1) = pts[over - 1], pts[over]
    return r0 + (threshold - v0) / (v1 - v0) * (r1 - r0), None


def _count(points: list[dict], a: str, b: str, key: str) -> tuple[int, int]:
    """At how many common rates variant `a` has a lower `key` than variant `b` (of how many rates)."""
    va = {p["request_rate"]: p[key] for p in points if p["variant"] == a}
    vb = {p["request_rate"]: p[key] for p in points if p["variant"] == b}
    rates = sorted(set(va) & set(vb))
    return sum(va[x] < vb[x] for x in rates), len(rates)


# Sarathi-Serve's strict SLO: P99 time between tokens within 5x a decode iteration without prefill interference.
ITL_SLO_FACTOR = 5.0


def chunked_prefill(results: dict, figures: Figures) -> str:
    head = ("## Beyond the paper — chunked prefill\n\nClaims: Sarathi-Serve (Agrawal et al., OSDI'24) serves up to "
            "2.6× the load of vLLM for Mistral-7B on one A100 and 3.7× for Yi-34B on two A100s under tail-latency "
            "SLOs, by chunked prefills and stall-free batching (decodes never wait behind a whole prompt). vLLM's "
            "documentation: with chunked prefill, a smaller `max_num_batched_tokens` gives better inter-token latency "
            "(fewer prompt tokens slow each decode), a larger one better time to first token; chunking batches "
            "compute-bound prefill with memory-bound decode.\n\n")
    r = finished(results, "chunked_prefill", "sustained_rate")
    if r is None:
        return head + not_run("chunked_prefill")
    points, variants = r["points"], list(r["sustained_rate"])
    cfg = r["provenance"]["config"]
    rows = ["| variant | rate (req/s) | norm. latency (s/token) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
            "TPOT p50 (ms) |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (variants.index(p["variant"]), p["request_rate"])):
        rows.append(f"| {p['variant']} | {p['request_rate']:g} | {p['normalized_latency']:.3f} | "
                    f"{p['median_ttft_ms']:.0f} / {p['p99_ttft_ms']:.0f} | {p['median_itl_ms']:.1f} / "
                    f"{p['p99_itl_ms']:.1f} | {p['median_tpot_ms']:.1f} |")
    slo = ITL_SLO_FACTOR * min(p["median_itl_ms"] for p in points)
    capacity = {}
    for v in variants:
        mine = [p for p in points if p["variant"] == v]
        itl, itl_c = _crossing(mine, "p99_itl_ms", slo)
        lat, lat_c = _crossing(mine, "normalized_latency", r["latency_threshold"])
        capacity[v] = (itl, itl_c) if itl <= lat else (lat, lat_c)
    base = next((v for v in variants if v.startswith("paper")), variants[0])
    chunked = [v for v in variants if v != base]
    cap_text = "; ".join(f"{v} {rate_cell(*capacity[v])} req/s ({capacity[v][0] / capacity[base][0]:.2f}× {base})"
                         for v in chunked)
    sust = "; ".join(f"{v} {rate_cell(x, r['sustained_rate_censored'][v])}" for v, x in r["sustained_rate"].items())
    budget = {x["name"]: x["max_num_batched_tokens"] for x in cfg["variants"]}
    by_budget = sorted(chunked, key=budget.get)
    small, large = (by_budget[0], by_budget[-1]) if len(by_budget) > 1 else (None, None)
    checks = ""
    if small:
        itl = _count(points, small, large, "p99_itl_ms")
        ttft50 = _count(points, large, small, "median_ttft_ms")
        ttft99 = _count(points, large, small, "p99_ttft_ms")
        vs_paper = _count(points, large, base, "p99_itl_ms")
        checks = (f"- Smaller budget, better ITL: {small}'s p99 ITL is below {large}'s at {itl[0]} of {itl[1]} rates.\n"
                  f"- Larger budget, better TTFT: {large}'s median TTFT is below {small}'s at {ttft50[0]} of {ttft50[1]} "
                  f"rates, its p99 TTFT at {ttft99[0]} of {ttft99[1]}.\n"
                  f"- No generation stalls: {large}'s p99 ITL is below {base}'s at {vs_paper[0]} of {vs_paper[1]} rates "
                  f"(the paper's scheduler runs a whole prompt step between two decode steps).\n")
    real = r.get("real")
    real_rows = ""
    if real:
        rr = ["| variant (real model, CPU, wall clock) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | wall (s) |",
              "|---|---|---|---|"]
        for row in real["rows"]:
            rr.append(f"| {row['variant']} | {row['median_ttft_ms']:.0f} / {row['p99_ttft_ms']:.0f} | "
                      f"{row['median_itl_ms']:.1f} / {row['p99_itl_ms']:.1f} | {row['wall_s']:.1f} |")
        load = ", ".join(f"{x:.1f}" for x in real.get("load_average", [])) or "not recorded"
        real_rows = (f"\n\nThe same engine with the real model ({cfg['real']['model']['name']}, dummy weights, "
                     f"{real['rows'][0]['num_requests']} requests, lengths × {cfg['real']['length_scale']}) on this "
                     f"machine's CPU, load average {load}:\n\n" + "\n".join(rr)
                     + "\n\nThis shows the three variants run the same code on a real model; on a shared 2-core CPU, "
                     "where a step's time is the CPU's and the load of other jobs, its latencies say nothing about a GPU.")
    return head + f"""Command: {command("chunked_prefill")}. {cfg['model']['name']} on {cfg['sim']['tp']}× {cfg['sim']['gpu']},
{cfg['dataset']}, {cfg['duration_s']:.0f} s traces, the same trace for every variant at a rate (`chunked_prefill.json`).
Variants: the paper's scheduler with a 2048-token budget, and chunked prefill (decodes first, prompt chunks fill
the rest of the budget) at 2048 and 512 tokens. ITL = gaps between consecutive tokens of a request, pooled.

{chr(10).join(rows)}

{figures(("chunked_prefill.png", "Normalized latency, p99 TTFT, p99 ITL and median TPOT vs request rate per scheduling variant"))}

Sustained rate (normalized latency at 4× the sweep's lowest): {sust}. Capacity under a strict ITL SLO in the
manner of Sarathi-Serve (p99 ITL ≤ {ITL_SLO_FACTOR:g}× the sweep's lowest median ITL = {slo:.0f} ms, and latency still
sustained): {base} {rate_cell(*capacity[base])} req/s; {cap_text}.

Where ours agrees, number by number:
{checks}- Capacity: Sarathi-Serve's 2.6× and 3.7× are against a vLLM whose decodes stall behind prompts under an SLO
  on P99 time between tokens; our gain under the analogous SLO is the ratio above. OPT-13B's 15,728 KV slots
  hold only ~37 ShareGPT requests (memory, not prefill interference, caps the batch), while Mistral-7B keeps
  128 KB of KV per token (grouped-query attention) against OPT-13B's 800 KB, so its batches are several times
  larger and the prompt stalls that chunking removes weigh more in its tail.{real_rows}"""
