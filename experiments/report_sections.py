"""The sections of results/REPORT.md: each takes every loaded result (file stem -> JSON) and
returns its markdown. Numbers are read from the results; the prose says why they differ."""

from __future__ import annotations

from jpaged.systems import LABELS

ORCAS = ("orca_oracle", "orca_pow2", "orca_max")
# (result stem, panel label) of Figs. 12/13, in the paper's order.
PANELS = (("throughput_opt13b_sharegpt", "OPT-13B, 1×A100-40GB, ShareGPT"),
          ("throughput", "same, default config"),
          ("throughput_opt66b_sharegpt", "OPT-66B, 4×A100-40GB, ShareGPT"),
          ("throughput_opt175b_sharegpt", "OPT-175B, 8×A100-80GB, ShareGPT"),
          ("throughput_opt13b_alpaca", "OPT-13B, 1×A100-40GB, Alpaca"),
          ("throughput_opt66b_alpaca", "OPT-66B, 4×A100-40GB, Alpaca"),
          ("throughput_opt175b_alpaca", "OPT-175B, 8×A100-80GB, Alpaca"))


def _cmd(name: str, config: str | None = None) -> str:
    return f"`python -m experiments.{name} --config configs/{config or name}.yaml`"


def _missing(name: str, config: str | None = None) -> str:
    return f"*Not run yet: {_cmd(name, config)}.*"


def _span(values: list[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    lo, hi = min(values), max(values)
    return (fmt.format(lo) + unit) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}{unit}"


def _final(results: dict, stem: str, key: str) -> dict | None:
    """The result `stem` if its run finished (it has `key`; a sweep in progress holds only points)."""
    r = results.get(stem)
    return r if r is not None and key in r else None


def _rate(rate: float, censored: str | None) -> str:
    return f"{rate:.2f}" + {"above_sweep": "+", "below_sweep": "−"}.get(censored or "", "")


def header(results: dict) -> str:
    return """# jpaged results against the paper

Each section: the paper's claim, our numbers, the command that made them, and where and why the
two differ. This file is generated: `python -m experiments.report` (or
`python -m experiments.reproduce_all`) rewrites it from `results/*.json`, so every number below
comes from a committed result. All serving figures are **simulated** unless a section says
otherwise: the scheduler, block manager and baseline allocators run for real; only step times
come from the roofline cost model (`jpaged/sim/cost_model.py`, datasheet A100 numbers, efficiency
factors not fitted to the paper). Systems are built by `jpaged/systems.py`. Sustained rate = where
normalized latency crosses 4× the sweep's lowest, interpolated (`+`: still under it at the
highest rate swept; `−`: over it at the lowest). Claims marked "(§x, our reading)" are quoted from
the paper's text as we read it; PAPER.md holds the rest."""


def memory_waste(results: dict) -> str:
    head = "## Fig. 2 — KV cache memory waste\n\nClaim (§1, Fig. 2): existing systems store token states in only " \
           "20.4%–38.2% of the KV cache; vLLM wastes under 4%.\n\n"
    r = results.get("memory_waste")
    if r is None:
        return head + _missing("memory_waste")
    rows = ["| system | token states | reserved | internal frag. | external frag. | free |", "|---|---|---|---|---|---|"]
    for system, v in r["systems"].items():
        rows.append(f"| {LABELS[system]} | " + " | ".join(f"{v[k]:.1f}" for k in
                                                          ("token_states", "reserved", "internal", "external", "free")) + " |")
    orca = [v["token_states"] for s, v in r["systems"].items() if s != "vllm"]
    v = r["systems"].get("vllm", {})
    waste = v.get("reserved", 0.0) + v.get("internal", 0.0)
    cfg = r["provenance"]["config"]
    return head + f"""Command: {_cmd("memory_waste")}. Setup: {cfg["model"]["name"]}, {cfg["sim"]["tp"]}× {cfg["sim"]["gpu"]},
{cfg["dataset"]} at {cfg["request_rate"]} req/s for {cfg["duration_s"]:.0f} simulated seconds, the same trace for every
system; time-averaged percent of the slot space (`results/memory_waste.json`, figures `memory_waste.png`,
`memory_waste_pool.png`).

{chr(10).join(rows)}

Agreement: token states span {_span(orca)}% for the Orca variants (paper 20.4%–38.2%), and vLLM wastes
{waste:.1f}% (reserved + internal; paper < 4%). Definitions (`jpaged/kv_usage.py`): a sequence writes K/V for
its first final_len − 1 positions; *reserved* = allocated slots it will still write, *internal* = allocated
slots nobody will write (Orca's over-reservation and the buddy's rounding; vLLM's slots of a sequence's final
block past its end), *external* = free slots in buddy blocks smaller than the region the head of the waiting
queue needs. vLLM's waste is the unfilled tail of each sequence's current last block, which that sequence will
still fill; its free share is the admission watermark plus the gap left when the next request needs more blocks
than are free — not fragmentation, since any free block serves any request. Orca's external fragmentation is
similar for every policy: the pool is not a multiple of the largest region, and the remainder serves no
maximum-length reservation."""


def throughput(results: dict) -> str:
    head = ("## Figs. 12 and 13 — normalized latency and batch size vs request rate\n\nClaim: vLLM sustains 2–4× the "
            "request rate of FasterTransformer and Orca at similar latency (PAPER.md); 1.7–2.7× over Orca (Oracle) and "
            "2.7–8× over Orca (Max) on ShareGPT, up to 22× over FasterTransformer, a smaller advantage on Alpaca, "
            "smallest for OPT-175B (§6.2, our reading).\n\n")
    rows = ["| panel (command: `python -m experiments.throughput --config configs/<config>`) | trace | vLLM | "
            "Orca Oracle | Orca Pow2 | Orca Max | FT | wall |", "|---|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {"orca_oracle": [], "orca_max": [], "batch": []}
    for stem, label in PANELS:
        r = results.get(stem)
        if r is None:
            rows.append(f"| {label} (`{stem}.yaml`) | not run yet | | | | | | |")
            continue
        rates, cens = r["sustained_rate"], r["sustained_rate_censored"]
        v = rates["vllm"]
        cells = [_rate(v, cens["vllm"])] + [f"{_rate(rates[s], cens[s])} ({v / rates[s]:.2f}×)" if s in rates else ""
                                            for s in (*ORCAS, "fastertransformer")]
        minutes = r["provenance"]["config"]["duration_s"] / 60
        trace = f"{minutes / 60:.0f} h" if minutes >= 60 else f"{minutes:.0f} min"
        rows.append(f"| {label} (`{stem}.yaml`) | {trace} | " + " | ".join(cells) + f" | {r['total_wall_s']:.0f} s |")
        if "sharegpt" in stem:
            for s in ("orca_oracle", "orca_max"):
                ratios[s].append(v / rates[s])
            batch = {s: max(p["avg_batched_requests"] for p in r["points"] if p["system"] == s) for s in ("vllm", "orca_max")}
            ratios["batch"].append(batch["vllm"] / batch["orca_max"])
    agree = (f"on ShareGPT vLLM beats Orca (Oracle) by {_span(ratios['orca_oracle'])}× and Orca (Max) by "
             f"{_span(ratios['orca_max'])}×, and at saturation batches {_span(ratios['batch'])}× more requests than "
             "Orca (Max) (Fig. 13: the baselines' batch curves flatten where their memory runs out); the advantage "
             "shrinks on Alpaca and is smallest for OPT-175B, as in the paper." if ratios["orca_max"] else "no ShareGPT panel yet.")
    return head + "\n".join(rows) + f"""

Figures: `results/throughput*.png` (left: Fig. 12, normalized latency; right: Fig. 13, average batched
requests). Each point's JSON entry also holds vLLM's benchmark metrics (TTFT, TPOT, E2E percentiles),
throughputs, preemptions and its wall time.

Agreement: {agree}
Differences and why:
- Our absolute rates are higher than the paper's plots: the roofline cost model has no kernel inefficiencies
  beyond its efficiency factors and no Python/runtime overhead of 2023 vLLM, so steps are faster.
- Where memory is abundant (OPT-175B), Orca (Oracle)'s exact reservations already fit large batches and the
  model is compute-bound sooner in our cost model, so the gap is below the paper's range.
- FasterTransformer and Orca (Max) ratios on Alpaca are larger than the paper's: with short requests,
  reserving 2048 slots each limits them to a handful of requests, while we model FT as the same engine with
  request-level batching, not FT's faster fused kernels.
- OPT-175B Alpaca is compute-bound: a baseline's smaller admitted batch may queue new requests instead of
  slowing every running one, so its latency can dip below vLLM's past the knee.
- FasterTransformer's curve is not monotone at the lowest rates: a request arriving during a batch waits for
  the whole batch, so its latency depends on which batch it hits.
- Traces are shorter than the paper's 1 h except OPT-13B ShareGPT (wall-time budget here); above the knee
  latency grows with trace length, so the knee is slightly softer."""


def real_executor(results: dict) -> str:
    out = "## Simulator speed\n\nRequirement: one simulated hour of OPT-13B on ShareGPT at 2 req/s in at most 20 s here.\n"
    r = results.get("throughput_opt13b_sharegpt")
    point = next((p for p in r["points"] if p["system"] == "vllm" and p["request_rate"] == 2.0), None) if r else None
    out += (f"Measured: {point['wall_s']:.2f} s wall ({point['completed']:,} requests, {point['num_steps']:,} steps) — the "
            "`vllm` point at 2.0 req/s of `results/throughput_opt13b_sharegpt.json` (`wall_s`), on the shared 2-core "
            "machine." if point else _missing("throughput", "throughput_opt13b_sharegpt"))
    out += "\n\n## Real executor through the same path\n\n"
    r = results.get("throughput_tiny_jax")
    if r is None:
        return out + _missing("throughput", "throughput_tiny_jax")
    n = r["provenance"]["config"].get("num_requests")
    return out + (f"{_cmd('throughput', 'throughput_tiny_jax')} serves {n} Alpaca-shaped requests per system with "
                  f"{r['provenance']['config']['model']['name']} (dummy weights) via `executor: jax` on "
                  f"{r['provenance'].get('device', '?')} (`results/throughput_tiny_jax.json`, {r['total_wall_s']:.0f} s of "
                  "serving). Its latencies are wall times and only show the path works. "
                  "`tests/baselines/test_contiguous.py::test_real_model_tokens_match_vllm` checks that Orca's contiguous "
                  "regions give the same greedy tokens as vLLM's paged blocks.")


def host_and_real_engine(results: dict) -> str:
    """Host overhead per sequence-step, and the real engine against static batching on this CPU."""
    out = "## Host overhead and the real engine on this CPU\n\n"
    b = results.get("bench_host")
    if b is None:
        out += _missing("bench_host") + "\n\n"
    else:
        out += (f"{_cmd('bench_host')}: {b['num_requests']:,} ShareGPT-shaped requests at once at the OPT-13B / A100-40GB "
                f"budget, no model, prefix caching and swap on: {b['steps']:,} steps, {b['seq_steps']:,} sequence-steps, "
                f"**{b['us_per_seq_step']:.2f} µs per sequence-step** (target <= {b['target_us_per_seq_step']:.1f}), "
                f"{b['num_preemptions']:,} preemptions; scheduler, block manager, StepPlan arrays and token bookkeeping "
                "together.\n\n")
    r = results.get("serve_real")
    if r is None:
        return out + _missing("serve_real")
    cfg = r["provenance"]["config"]
    return out + (f"{_cmd('serve_real')}: {cfg['num_requests']} ShareGPT-shaped requests (lengths x {cfg['length_scale']}) on "
                  f"{cfg['model']['name']} (dummy weights, {cfg['model']['dtype']}) on {r['provenance'].get('device', '?')}, "
                  f"the same {r['kv_slots']:,} KV slots for both: the paged engine makes **{r['paged_tok_s']:.0f} output "
                  f"tok/s**, static batching over a contiguous cache (batches of {cfg['baseline_batch_size']}, each run to "
                  f"its longest request) {r['baseline_tok_s']:.0f} tok/s: **{r['ratio']:.1f}x** (target >= "
                  f"{r['target_ratio']:.0f}x). Greedy outputs differ for {r['outputs_differ']} of {cfg['num_requests']} "
                  f"requests; compilations: {r['paged_compilations']} (paged), {r['baseline_compilations']} (static). "
                  "Each system runs the workload twice and the second, compiled run is timed. The gap comes from the "
                  "rows static batching keeps computing after their request ended and from its smaller batches.")


def parallel_sampling(results: dict) -> str:
    head = ("## Figs. 14 and 15 — parallel sampling and beam search\n\nClaim: sharing saves memory in parallel sampling "
            "and much more in beam search (PAPER.md); on Alpaca 6.1%–9.8% (parallel) and 37.6%–55.2% (beam), on "
            "ShareGPT 16.2%–30.5% and 44.3%–66.3%; vLLM's advantage over Orca grows with the number of sequences, "
            "1.3× over Orca (Oracle) for beam width 2 to 2.3× for width 6 (§6.3, our reading).\n\n")
    r = _final(results, "parallel_sampling", "memory_saving")
    if r is None:
        return head + _missing("parallel_sampling")
    rows = ["| dataset | mode | " + " | ".join(f"width {w}" for w in next(iter(next(iter(r["memory_saving"].values())).values())))
            + " |", "|---|---|" + "---|" * len(next(iter(next(iter(r["memory_saving"].values())).values())))]
    for d, modes in r["memory_saving"].items():
        for m, by in modes.items():
            rows.append(f"| {d} | {m} | " + " | ".join(f"{v:.1f}%" for v in by.values()) + " |")
    rates = ["| panel | vLLM | Orca Oracle | Orca Pow2 | Orca Max |", "|---|---|---|---|---|"]
    oracle_ratio = {}
    for key, by in r["sustained_rate"].items():
        c = r["sustained_rate_censored"][key]
        v = by["vllm"]
        rates.append(f"| {key} | {_rate(v, c['vllm'])} | " + " | ".join(
            f"{_rate(by[s], c[s])} ({v / by[s]:.2f}×)" if s in by else "" for s in ORCAS) + " |")
        if "orca_oracle" in by:
            oracle_ratio[key] = v / by["orca_oracle"]
    cfg = r["provenance"]["config"]
    beam = [v for k, v in oracle_ratio.items() if ".beam" in k]
    par = [v for k, v in oracle_ratio.items() if ".parallel" in k]
    return head + f"""Command: {_cmd("parallel_sampling")} ({r['total_wall_s']:.0f} s). {cfg['model']['name']} on
{cfg['sim']['tp']}× {cfg['sim']['gpu']}, {cfg['duration_s']:.0f} s traces; figures `parallel_sampling.png` (Fig. 14) and
`parallel_sampling_saving.png` (Fig. 15). Memory saving = 1 − blocks in use / blocks without sharing, from the
block manager's refcounts at every step, time-weighted, on vLLM at {", ".join(f"{d} {x} req/s" for d, x in cfg['saving_rate'].items())}:

{chr(10).join(rows)}

Sustained rates (req/s; ratio = vLLM / system):

{chr(10).join(rates)}

Agreement: beam search saves far more memory than parallel sampling, and more with wider beams; vLLM's
advantage over Orca (Oracle) is {_span(par, "{:.2f}")}× with parallel sampling and {_span(beam, "{:.2f}")}× with beam search.
Against the paper's ranges: {_saving_vs_paper(r["memory_saving"])}.
Differences and why: only full prompt blocks stay shared between parallel samples (the partial last block is
copied at the first decode step, and samples share nothing after), and our time-weighted average counts each
sample's growing output, which dilutes the shared prompt as generation proceeds (the paper does not state its
averaging); short Alpaca prompts (median ~17 tokens) fill at most one block. Beam candidates under
the simulator are seeded random log-probabilities, not a model's, so how often beams branch (and thus the
beam saving) is a property of those draws. Orca serves each group with one contiguous region per sequence,
reserved at admission, and copies the parent's KV into it at every fork (`jpaged/baselines/contiguous.py`)."""


# Fig. 15 as we read §6.3: memory saving ranges over widths 2-6, percent.
PAPER_SAVING = {"alpaca": {"parallel": (6.1, 9.8), "beam": (37.6, 55.2)},
                "sharegpt": {"parallel": (16.2, 30.5), "beam": (44.3, 66.3)}}


def _saving_vs_paper(saving: dict) -> str:
    """Per dataset and mode: our range, the paper's, and whether ours is below, within or above it."""
    parts = []
    for d, modes in saving.items():
        for m, by in modes.items():
            lo, hi = PAPER_SAVING[d][m]
            ours = list(by.values())
            where = ("below" if max(ours) < lo else "above" if min(ours) > hi
                     else "overlapping" if not (lo <= min(ours) and max(ours) <= hi) else "within")
            parts.append(f"{d} {m} {_span(ours)}% vs {lo}–{hi}% ({where})")
    return "; ".join(parts)


def shared_prefix(results: dict) -> str:
    head = ("## Fig. 16 — shared prefix\n\nClaim: shared prefixes help (PAPER.md); vLLM reaches 1.67× the throughput "
            "of Orca (Oracle) with a 1-shot prefix and 3.58× with 5-shot (§6.4, our reading).\n\n")
    r = _final(results, "shared_prefix", "sustained_rate")
    if r is None:
        return head + _missing("shared_prefix")
    lines = []
    for n, by in r["sustained_rate"].items():
        c = r["sustained_rate_censored"][n]
        hit = max(p.get("prefix_cache_hit_rate", 0.0) for p in r["points"] if str(p["prefix_len"]) == n)
        lines.append(f"| {n} | {_rate(by['vllm'], c['vllm'])} | {_rate(by['orca_oracle'], c['orca_oracle'])} | "
                     f"{by['vllm'] / by['orca_oracle']:.2f}× | {100 * hit:.0f}% |")
    cfg = r["provenance"]["config"]
    return head + f"""Command: {_cmd("shared_prefix")} ({r['total_wall_s']:.0f} s). {cfg['model']['name']} on
{cfg['sim']['tp']}× {cfg['sim']['gpu']} ({cfg['executor']}), task inputs LogNormal(median {cfg['input_median']:.0f} tokens),
outputs {cfg['output_ratio']}× the input (an assumption for WMT16 En→De); figure `shared_prefix.png`.

| prefix tokens | vLLM (req/s) | Orca Oracle (req/s) | ratio | vLLM prompt tokens from the cache |
|---|---|---|---|---|
{chr(10).join(lines)}

Agreement: the longer the shared prefix, the larger vLLM's advantage, as in the paper. Differences and why:
our prefix cache fills itself from the first request rather than being pre-stored, so the first request pays
the prefix; the last partial prefix block (341 = 21 × 16 + 5 tokens) is recomputed by every request; and the
simulator prices prefill by FLOPs, so skipping the prefix saves compute as well as the memory that lets vLLM
batch more requests."""


def chatbot(results: dict) -> str:
    head = ("## Fig. 17 — chatbot\n\nClaim: vLLM sustains 2× higher request rates than the three Orca baselines, which "
            "behave alike because long prompts make the buddy allocator reserve 1024 output slots whatever the "
            "prediction (§6.5, our reading).\n\n")
    r = _final(results, "chatbot", "sustained_rate")
    if r is None:
        return head + _missing("chatbot")
    rates, c = r["sustained_rate"], r["sustained_rate_censored"]
    ratios = [rates["vllm"] / rates[s] for s in ORCAS if s in rates]
    cfg = r["provenance"]["config"]
    return head + f"""Command: {_cmd("chatbot")} ({r['total_wall_s']:.0f} s), figure `chatbot.png`. Conversations of
Geometric(mean {cfg['mean_rounds']}) rounds synthesized from the ShareGPT shapes; each round's prompt is the history
plus the query, cut to the last {cfg['max_prompt_len']} tokens (mean prompt {r['mean_prompt_len']:.0f} tokens,
{100 * r['frac_prompts_at_cut']:.0f}% at the cut; mean output {r['mean_output_len']:.0f}); no cache kept across rounds.

Sustained rates (req/s): vLLM {_rate(rates['vllm'], c['vllm'])}; """ + "; ".join(
        f"{LABELS[s]} {_rate(rates[s], c[s])}" for s in ORCAS if s in rates) + f""".

Agreement: vLLM sustains {_span(ratios, "{:.2f}")}× the Orca variants' rates, and the three variants sit close together.
Differences and why: our conversations are synthesized (the number of rounds is an assumption), so the share
of prompts at the 1024 cut, which drives Orca's 2048-slot regions, is ours rather than ShareGPT's."""


def kernel_and_block_size(results: dict) -> str:
    out = ("## Fig. 18 — kernel overhead and block size\n\nClaim: the PagedAttention kernel has 20–26% higher attention "
           "latency than a contiguous kernel (PAPER.md); block sizes 16–128 work best on ShareGPT and 16–32 on Alpaca, "
           "16 is the default (§7.2, our reading).\n\n")
    k = results.get("kernel_bench")
    if k is None:
        out += _missing("kernel_bench") + "\n\n"
    else:
        s = k["summary"]
        out += (f"Fig. 18a: {_cmd('kernel_bench')} on {k['device']} ({k['backend']} path): paged / contiguous decode "
                f"attention time median {s['median_paged_over_contiguous']:.2f}×, at the largest point per block size "
                + ", ".join(f"{b}: {v:.2f}×" for b, v in s["largest_point_paged_over_contiguous"].items())
                + " (`kernel_bench.png`). On a CPU these are XLA gathers timed on a shared 2-core machine, not the "
                "paper's GPU kernel; GPU rows replace them when `experiments/gpu_check.sh` runs on a GPU.\n\n")
    r = _final(results, "block_size", "best_block_size")
    if r is None:
        return out + _missing("block_size")
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
    return out + f"""Fig. 18b: {_cmd("block_size")} ({r['total_wall_s']:.0f} s), vLLM, {rates}, the same KV slots at every
block size; figure `block_size.png`. Kernel costs per block size from `kernel_bench*.json` rows on
{r['kernel_overhead_device']}.

{chr(10).join(rows)}

Best block size: """ + ", ".join(f"{d} {b}" for d, b in r["best_block_size"].items()) + "; within 10% of the best: " + "; ".join(
        f"{d} " + ", ".join(str(p["block_size"]) for p in r["points"] if p["dataset"] == d and p["normalized_latency"]
                            <= 1.1 * min(q["normalized_latency"] for q in r["points"] if q["dataset"] == d))
        for d in datasets) + """.
Agreement and differences: the largest blocks hurt most on Alpaca, whose sequences are shorter than a block (one
block per sequence wastes most of its slots, so fewer requests fit), and a broad middle range is near the best,
as in the paper. Small blocks are penalized here only through the kernel cost measured at that block size; with
CPU rows that cost is an XLA gather's on a shared 2-core machine, noisy and not the GPU kernel's, so the ranking
inside the middle range follows that noise (and, on compute-bound Alpaca, the smaller batches that large blocks
admit) rather than the paper's GPU trade-off."""


def preemption(results: dict) -> str:
    head = ("## Fig. 19 — recompute vs swap\n\nClaim: swapping is slow at small block sizes (many small PCIe "
            "transfers); recompute cost does not depend on block size; block sizes 16–64 work well for both (PAPER.md).\n\n")
    r = _final(results, "preemption", "real")
    if r is None:
        return head + _missing("preemption")
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
    return head + f"""Command: {_cmd("preemption")}; figure `preemption.png`. (a) one sequence of {cfg['seq_len']} tokens:
measured with the real executor ({cfg['real_model']['name']}, dummy weights) on {r['real_device']}, and from the cost
model for {cfg['model']['name']} on {r['modeled_gpu']}; (b) simulated vLLM serving {cfg['dataset']} at
{cfg['request_rate']} req/s with {cfg['kv_slots']} KV slots, so that requests are preempted.

{chr(10).join(rows)}

Agreement: the modeled swap at block size {model[0]['block_size']} costs {ratio:.1f}× its cheapest (one copy per block
per layer, each with a fixed setup cost), while recompute does not depend on block size; in serving, swap
suffers at small blocks and both modes are close in the middle of the range. Differences and why: on a CPU host
the "device" pool is host memory, so the measured swap is a memcpy with small per-block costs and no PCIe; the
measured recompute is a CPU prefill, far slower than a GPU's, so on this machine swapping is always cheaper —
the GPU trade-off appears only in the modeled columns and in (b)."""
