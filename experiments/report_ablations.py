"""REPORT.md sections for Figs. 18-19: kernel overhead and block size, recompute vs swap."""

from __future__ import annotations

from experiments.report_sections import Figures, command, finished, not_run, rate_cell

PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}  # block sizes that work best (§7.2, our reading)


def kernel_and_block_size(results: dict, figures: Figures) -> str:
    out = ("## Fig. 18 — kernel overhead and block size\n\nClaim: the PagedAttention kernel has 20–26% higher attention "
           "latency than a contiguous kernel (§7.1, Fig. 18a); block sizes 16–128 work best on ShareGPT and 16–32 on Alpaca, "
           "16 is the default (§7.2, our reading).\n\n")
    k = results.get("kernel_bench")
    if k is None:
        out += not_run("kernel_bench") + "\n\n"
    else:
        s = k["summary"]
        out += (f"Fig. 18a: {command('kernel_bench')} on {k['device']} ({k['backend']} path): paged / contiguous decode "
                f"attention time median {s['median_paged_over_contiguous']:.2f}×, at the largest point per block size "
                + ", ".join(f"{b}: {v:.2f}×" for b, v in s["largest_point_paged_over_contiguous"].items())
                + ". On a CPU these are XLA gathers timed on a shared 2-core machine, not the paper's GPU kernel; "
                "GPU rows replace them when `experiments/gpu_check.sh` runs on a GPU.\n\n"
                + figures(("kernel_bench.png", "Fig. 18a: decode attention latency, paged vs contiguous")) + "\n\n")
    r = finished(results, "block_size", "best_block_size")
    if r is None:
        return out + not_run("block_size")
    datasets = list(r["best_block_size"])
    sizes = sorted({p["block_size"] for p in r["points"]})
    rows = ["| block size | " + " | ".join(f"{d} (s/token)" for d in datasets) + " | kernel overhead (source) |",
            "|---|" + "---|" * (len(datasets) + 1)]
    for b in sizes:
        pts = {p["dataset"]: p for p in r["points"] if p["block_size"] == b}
        any_p = next(iter(pts.values()))
        rows.append(f"| {b} | " + " | ".join(f"{pts[d]['normalized_latency']:.4f}" for d in datasets)
                    + f" | {any_p['paged_attention_overhead']:.2f} ({any_p['overhead_source']}) |")
    rates = ", ".join(f"{d} at {p['request_rate']} req/s" for d in datasets
                      for p in [next(p for p in r["points"] if p["dataset"] == d)])
    sources = ", ".join(f"`{path}`" for path in r["provenance"]["config"]["kernel_bench"])
    return out + f"""Fig. 18b: {command("block_size")} ({r['total_wall_s']:.0f} s), vLLM, {rates}, the same KV slots at every
block size. Kernel costs per block size from the rows of {sources} on {r['kernel_overhead_device']}.

{chr(10).join(rows)}

{figures(("block_size.png", "Fig. 18b: normalized latency vs block size"))}

Best block size: """ + ", ".join(f"{d} {b}" for d, b in r["best_block_size"].items()) + "; within 10% of the best: " + "; ".join(
        f"{d} " + ", ".join(str(p["block_size"]) for p in r["points"] if p["dataset"] == d and p["normalized_latency"]
                            <= 1.1 * min(q["normalized_latency"] for q in r["points"] if q["dataset"] == d))
        for d in datasets) + """.
Against the paper's best ranges, per value: """ + "; ".join(
        f"{d}: best {b} " + ("within" if PAPER_BEST[d][0] <= b <= PAPER_BEST[d][1] else "outside")
        + f" {PAPER_BEST[d][0]}–{PAPER_BEST[d][1]}" for d, b in r["best_block_size"].items() if d in PAPER_BEST) + """.
Agreement and differences: the largest blocks hurt most on Alpaca, whose sequences are shorter than a block (one
block per sequence wastes most of its slots, so fewer requests fit), and a broad middle range is near the best,
as in the paper. Small blocks are penalized here only through the kernel cost measured at that block size; with
CPU rows that cost is an XLA gather's on a shared 2-core machine, noisy and not the GPU kernel's, so the ranking
inside the middle range follows that noise (and, on compute-bound Alpaca, the smaller batches that large blocks
admit) rather than the paper's GPU trade-off."""


def preemption(results: dict, figures: Figures) -> str:
    head = ("## Fig. 19 — recompute vs swap\n\nClaim: swapping is slow at small block sizes (many small PCIe "
            "transfers); recompute cost does not depend on block size; block sizes 16–64 work well for both (§7.3, Fig. 19).\n\n")
    r = finished(results, "preemption", "real")
    if r is None:
        return head + not_run("preemption")
    cfg = r["provenance"]["config"]
    rows = ["| block size | real swap out (ms) | real swap in (ms) | real recompute (ms) | A100 swap out (ms) | "
            "A100 recompute (ms) | recompute (s/token) | swap (s/token) |", "|---|---|---|---|---|---|---|---|"]
    for real, model in zip(r["real"], r["modeled"]):
        lat = {p["mode"]: p for p in r["points"] if p["block_size"] == real["block_size"]}
        rows.append(f"| {real['block_size']} | {1e3 * real['swap_out_s']:.2f} | {1e3 * real['swap_in_s']:.2f} | "
                    f"{1e3 * real['recompute_s']:.1f} | {1e3 * model['swap_out_s']:.2f} | {1e3 * model['recompute_s']:.2f} | "
                    f"{lat['recompute']['normalized_latency']:.4f} | {lat['swap']['normalized_latency']:.4f} |")
    model = r["modeled"]
    ratio = model[0]["swap_out_s"] / min(m["swap_out_s"] for m in model)
    lat = {(p["mode"], p["block_size"]): p["normalized_latency"] for p in r["points"]}
    sizes = sorted({b for _, b in lat})
    small = sizes[0]
    middle = [b for b in sizes if 16 <= b <= 64]
    gap = [lat[("swap", b)] / lat[("recompute", b)] for b in middle]
    best = {m: min(lat[(m, b)] for b in sizes) for m in ("swap", "recompute")}
    good = {m: [b for b in sizes if lat[(m, b)] <= 1.1 * best[m]] for m in best}
    return head + f"""Command: {command("preemption")}. (a) one sequence of {cfg['seq_len']} tokens:
measured with the real executor ({cfg['real_model']['name']}, dummy weights) on {r['real_device']}, and from the cost
model for {cfg['model']['name']} on {r['modeled_gpu']}; (b) simulated vLLM serving {cfg['dataset']} at
{cfg['request_rate']} req/s with {cfg['kv_slots']} KV slots, so that requests are preempted.

{chr(10).join(rows)}

{figures(("preemption.png", "Fig. 19: (a) swap and recompute cost vs block size, measured and modeled; (b) latency"))}

Agreement: the modeled swap at block size {model[0]['block_size']} costs {ratio:.1f}× its cheapest (one copy per block
per layer, each with a fixed setup cost), while recompute does not depend on block size. In serving (b), swap's
latency at block {small} is {lat[("swap", small)] / lat[("recompute", small)]:.2f}× recompute's; at blocks {middle[0]}–{middle[-1]} swap / recompute is
{min(gap):.2f}–{max(gap):.2f}×; within 10% of each mode's best: swap at blocks {", ".join(map(str, good["swap"]))}, recompute at
{", ".join(map(str, good["recompute"]))} (paper: 16–64 work well for both). Differences and why: on a CPU host
the "device" pool is host memory, so the measured swap is a memcpy with small per-block costs and no PCIe; the
measured recompute is a CPU prefill, far slower than a GPU's, so on this machine swapping is always cheaper —
the GPU trade-off appears only in the modeled columns and in (b)."""


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
