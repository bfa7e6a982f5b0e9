"""REPORT.md section for Fig. 18b: normalized latency against block size. It continues the Fig. 18
heading that kernel_bench's section opens."""

from __future__ import annotations

from experiments.markdown import Figures, command, finished, not_run

PAPER_BEST = {"sharegpt": (16, 128), "alpaca": (16, 32)}  # block sizes that work best (§7.2, our reading)


def block_size(results: dict, figures: Figures) -> str:
    """Fig. 18b (under kernel_bench's Fig. 18 heading)."""
    r = finished(results, "block_size", "best_block_size")
    if r is None:
        return not_run("block_size")
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
    return f"""Fig. 18b: {command("block_size")} ({r['total_wall_s']:.0f} s), vLLM, {rates}, the same KV slots at every
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
