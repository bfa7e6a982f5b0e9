"""REPORT.md section for Fig. 18a: the paged kernel's decode attention latency against a contiguous
kernel. It opens the Fig. 18 heading; block_size's section (Fig. 18b) follows under it."""

from __future__ import annotations

from experiments.markdown import Figures, command, not_run


def kernel_bench(results: dict, figures: Figures) -> str:
    """Opens Fig. 18 with the paper's claims on both panels; Fig. 18a here, 18b in block_size's section."""
    out = ("## Fig. 18 — kernel overhead and block size\n\nClaim: the PagedAttention kernel has 20–26% higher attention "
           "latency than a contiguous kernel (§7.1, Fig. 18a); block sizes 16–128 work best on ShareGPT and 16–32 on Alpaca, "
           "16 is the default (§7.2, our reading).\n\n")
    k = results.get("kernel_bench")
    if k is None:
        return out + not_run("kernel_bench")
    s = k["summary"]
    return out + (f"Fig. 18a: {command('kernel_bench')} on {k['device']} ({k['backend']} path): paged / contiguous decode "
                  f"attention time median {s['median_paged_over_contiguous']:.2f}×, at the largest point per block size "
                  + ", ".join(f"{b}: {v:.2f}×" for b, v in s["largest_point_paged_over_contiguous"].items())
                  + ". On a CPU these are XLA gathers timed on a shared 2-core machine, not the paper's GPU kernel; "
                  "GPU rows replace them when `experiments/gpu_check.sh` runs on a GPU.\n\n"
                  + figures(("kernel_bench.png", "Fig. 18a: decode attention latency, paged vs contiguous")))
