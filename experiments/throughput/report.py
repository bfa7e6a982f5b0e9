"""REPORT.md section for Figs. 12 and 13: sustained rates per panel, both batch-size definitions
against the paper's Fig. 13, the batch limits per panel, and FasterTransformer's reading."""

from __future__ import annotations

from experiments.markdown import ORCAS, Figures, against, finished, rate_cell
from experiments.throughput import sustained_rates
from jpaged.paper.systems import LABELS

# (result stem, panel label) of Figs. 12/13, in the paper's order.
PANELS = (("throughput_opt13b_sharegpt", "OPT-13B, 1×A100-40GB, ShareGPT"),
          ("throughput", "same, default config"),
          ("throughput_opt66b_sharegpt", "OPT-66B, 4×A100-40GB, ShareGPT"),
          ("throughput_opt175b_sharegpt", "OPT-175B, 8×A100-80GB, ShareGPT"),
          ("throughput_opt13b_alpaca", "OPT-13B, 1×A100-40GB, Alpaca"),
          ("throughput_opt66b_alpaca", "OPT-66B, 4×A100-40GB, Alpaca"),
          ("throughput_opt175b_alpaca", "OPT-175B, 8×A100-80GB, Alpaca"))

# Fig. 13's bar labels (our reading of the figure): OPT-13B, average batched requests.
PAPER_FIG13 = {("throughput_opt13b_sharegpt", 2.0): {"orca_max": 7.00, "orca_pow2": 9.81, "orca_oracle": 13.62,
                                                     "vllm": 30.42},
               ("throughput_opt13b_alpaca", 30.0): {"orca_max": 7.00, "orca_pow2": 43.24, "orca_oracle": 72.75,
                                                   "vllm": 132.44}}
MODEL = {stem: stem.split("_")[1].upper().replace("OPT", "OPT-").replace("B", "B") for stem, _ in PANELS
         if stem != "throughput"}  # "throughput_opt13b_sharegpt" -> "OPT-13B"
SENSITIVITY = {"throughput_opt175b_alpaca_seqs1024": ("throughput_opt175b_alpaca", "max_num_seqs 1024"),
               "throughput_opt13b_sharegpt_ft_host": ("throughput_opt13b_sharegpt", "FasterTransformer pays vLLM's host line")}


def _at_threshold(sweep: dict, threshold: float) -> dict[str, dict]:
    """A sweep's sustained rates at another sweep's latency threshold (sensitivity runs)."""
    systems = list(dict.fromkeys(p["system"] for p in sweep["points"]))
    return sustained_rates(sweep["points"], systems, threshold)


def _rates_table(results: dict) -> tuple[list[str], dict[str, dict[str, float]]]:
    rows = ["| panel (command: `python -m experiments.throughput --config <config>`) | trace | vLLM | "
            "Orca Oracle | Orca Pow2 | Orca Max | FT | wall |", "|---|---|---|---|---|---|---|---|"]
    ratios: dict[str, dict[str, float]] = {}
    for stem, label in PANELS:
        r = finished(results, stem, "sustained_rate")
        if r is None:
            rows.append(f"| {label} (`configs/{stem}.yaml`) | not run yet | | | | | | |")
            continue
        rates, cens = r["sustained_rate"], r["sustained_rate_censored"]
        v = rates["vllm"]
        cells = [rate_cell(v, cens["vllm"])] + [f"{rate_cell(rates[s], cens[s])} ({v / rates[s]:.2f}×)" if s in rates
                                                else "" for s in (*ORCAS, "fastertransformer")]
        minutes = r["provenance"]["config"]["duration_s"] / 60
        trace = f"{minutes / 60:.0f} h" if minutes >= 60 else f"{minutes:.0f} min"
        rows.append(f"| {label} (`configs/{stem}.yaml`) | {trace} | " + " | ".join(cells) + f" | {r['total_wall_s']:.0f} s |")
        ratios[stem] = {s: v / rates[s] for s in rates if s != "vllm"}
    for stem, (main, what) in SENSITIVITY.items():
        r, m = finished(results, stem, "sustained_rate"), finished(results, main, "sustained_rate")
        if r is None or m is None:
            continue
        sens = _at_threshold(r, m["latency_threshold"])
        v = sens["vllm"]["rate"] if "vllm" in sens else m["sustained_rate"]["vllm"]  # else the main panel's vLLM
        cells = [rate_cell(sens["vllm"]["rate"], sens["vllm"]["censored"]) if "vllm" in sens else ""]
        cells += [f"{rate_cell(sens[s]['rate'], sens[s]['censored'])} ({v / sens[s]['rate']:.2f}×)" if s in sens else ""
                  for s in (*ORCAS, "fastertransformer")]
        rows.append(f"| sensitivity of {dict(PANELS)[main]}: {what} (`configs/{stem}.yaml`, at that panel's threshold) | "
                    f"{r['provenance']['config']['duration_s'] / 60:.0f} min | " + " | ".join(cells)
                    + f" | {r['total_wall_s']:.0f} s |")
    return rows, ratios


def _fig13_values(results: dict) -> list[dict]:
    """Per Fig. 13 bar we swept: trace, system, the paper's value, and our two counts."""
    out = []
    for (stem, rate), paper in PAPER_FIG13.items():
        r = results.get(stem)
        for system, value in (paper.items() if r is not None else ()):
            p = next((p for p in r["points"] if p["system"] == system and p["request_rate"] == rate), None)
            if p is not None and "requests_resident" in p:  # swept, and not a file older than both definitions
                out.append({"trace": "ShareGPT" if "sharegpt" in stem else "Alpaca", "rate": rate, "system": system,
                            "paper": value, "resident": p["requests_resident"], "per step": p["requests_per_step"]})
    return out


def _fig13(results: dict) -> tuple[str, str]:
    """The table of both batch sizes at the paper's Fig. 13 points, and what the paper's bars match."""
    bars = _fig13_values(results)
    if not bars:
        return "", ""
    rows = ["| trace, rate | system | paper (Fig. 13) | requests resident | requests per step | closer |",
            "|---|---|---|---|---|---|"]
    closer = {"resident": [], "per step": []}
    for b in bars:
        e = {k: b[k] / b["paper"] - 1 for k in ("resident", "per step")}
        b["closer"] = min(e, key=lambda k: abs(e[k]))
        b["error"] = e
        closer[b["closer"]].append(f"{b['trace']} {LABELS[b['system']]}")
        rows.append(f"| {b['trace']} {b['rate']:g} req/s | {LABELS[b['system']]} | {b['paper']:.2f} | {b['resident']:.2f} "
                    f"({100 * e['resident']:+.1f}%) | {b['per step']:.2f} ({100 * e['per step']:+.1f}%) | {b['closer']} |")
    text = (f"Requests resident is the closer count for {len(closer['resident'])} of {len(bars)} bars "
            f"({', '.join(closer['resident']) or 'none'}), requests per step for {len(closer['per step'])} "
            f"({', '.join(closer['per step']) or 'none'}).")
    by = {(b["trace"], b["system"]): b for b in bars}
    maxes = [b for b in bars if b["system"] == "orca_max"]
    vllm_alpaca = by.get(("Alpaca", "vllm"))
    if maxes and all(abs(b["error"]["resident"]) < 0.01 < -b["error"]["per step"] for b in maxes):
        text += (" The Orca (Max) bars decide it for the memory-bound systems: the paper prints 7.00 in both panels, "
                 "exactly floor(15,728 slots / 2,048) = 7, the maximum-length regions the pool holds — what a count of "
                 "requests resident reads whenever the queue never empties, and what a count per step reads only if "
                 "new prompts run in the same iterations as the running decodes (ours, with the paper's prompt-only "
                 "steps: " + ", ".join(f"{b['trace']} {b['per step']:.2f}" for b in maxes) + ").")
    if vllm_alpaca is not None and abs(vllm_alpaca["error"]["per step"]) < 0.05 < abs(vllm_alpaca["error"]["resident"]):
        text += (f" vLLM's Alpaca bar, where our vLLM is past its knee and memory-bound, is {100 * vllm_alpaca['error']['per step']:+.1f}% "
                 f"from our per-step count and {100 * vllm_alpaca['error']['resident']:+.0f}% from our resident one "
                 "(the pool's bound): vLLM's own bar reads as requests per step, prompt-only steps included.")
    others = [b for b in bars if b["system"] in ("orca_pow2", "orca_oracle") and b["trace"] == "Alpaca"]
    rest = (f"; it leaves our resident counts of Orca (Pow2) and (Oracle) on Alpaca "
            f"{100 * min(b['error']['resident'] for b in others):+.0f}% to {100 * max(b['error']['resident'] for b in others):+.0f}% "
            "from the paper's bars, a gap in reservation details between two reimplementations" if others else "")
    text += (" One reading is consistent with both: the paper counts the requests in each iteration's batch; vLLM's "
             "prompt-only iterations hold only the new prompts, while its Orca reimplementation, like Orca, batches "
             "new prompts with the running decodes, so for Orca that count equals the resident one" + rest + ". "
             "This is an inference from the bars, not something the paper states. We therefore plot both counts; the two differ by a few "
             "percent on ShareGPT (long outputs, few prompt-only steps) and by up to "
             f"{100 * max(b['resident'] / b['per step'] - 1 for b in bars):.0f}% on Alpaca. vLLM's ShareGPT bar is the "
             "least informative: below saturation both counts follow the arrival rate times the latency, which "
             "our simulated GPU sets, not the memory manager.")
    return "\n".join(rows), text


def _limits(results: dict) -> str:
    v = results.get("sim_validation")
    if v is None:
        return ""
    rows = ["| panel | max_num_seqs | memory-bound resident requests | vLLM resident at its top rate (steady state) | "
            "binds first |", "|---|---|---|---|---|"]
    for cap in v["panel_capacity"]:
        stem = cap["panel"].split("/")[-1].removesuffix(".yaml")
        r = results.get(stem)
        top = None
        if r is not None:
            top = max((p for p in r["points"] if p["system"] == "vllm"), key=lambda p: p["request_rate"])
        seen = (f"{top.get('steady_requests_resident') or top.get('requests_resident', 0):.0f} at "
                f"{top['request_rate']:g} req/s" if top else "—")
        rows.append(f"| `{stem}` | {cap['max_num_seqs']} | {cap['memory_bound_resident_requests']:.0f} | {seen} | "
                    f"{'the cap' if cap['cap_binds'] else 'memory'} |")
    return "\n".join(rows)


def _alpaca_batches(results: dict) -> str:
    """vLLM's resident requests at the swept rate nearest its sustained rate, over the Alpaca panels."""
    out = []
    for stem, _ in PANELS:
        r = finished(results, stem, "sustained_rate")
        if r is not None and "alpaca" in stem:
            knee = r["sustained_rate"]["vllm"]
            pts = [p for p in r["points"] if p["system"] == "vllm" and "requests_resident" in p]
            if pts:
                out.append(min(pts, key=lambda p: abs(p["request_rate"] - knee))["requests_resident"])
    return f"{min(out):.0f}–{max(out):.0f}" if out else "many"


def _host_share(results: dict) -> str:
    """The host's share of a simulated OPT-13B decode step at the largest batch sim_validation reports."""
    v = results.get("sim_validation")
    if v is None:
        return "host work is a large share of a big batch's step"
    p = max((p for p in v["opt13b_decode"] if p["context"] == min(q["context"] for q in v["opt13b_decode"])),
            key=lambda p: p["batch"])
    mid = [q for q in v["opt13b_decode"] if q["context"] == p["context"] and q["batch"] == 128]
    shares = " and ".join(f"{100 * q['host_s'] / q['step_s']:.0f}% at batch {q['batch']}" for q in mid + [p])
    gain = ""
    if mid:
        q = mid[0]
        gain = (f"; doubling the batch from {q['batch']} to {p['batch']} raises decode throughput by only "
                f"{100 * ((p['batch'] / p['step_s']) / (q['batch'] / q['step_s']) - 1):.0f}%")
    return f"host work is {shares} of a simulated OPT-13B decode step (context {p['context']}){gain}"


def throughput(results: dict, figures: Figures) -> str:
    head = ("## Figs. 12 and 13 — normalized latency and batch size vs request rate\n\nClaim: vLLM sustains 2–4× the "
            "request rate of FasterTransformer and Orca at similar latency (abstract); 1.7–2.7× over Orca (Oracle) and "
            "2.7–8× over Orca (Max) on ShareGPT, up to 22× over FasterTransformer, a smaller advantage on Alpaca, "
            "smallest for OPT-175B (§6.2); on OPT-13B, ShareGPT at 2 req/s, vLLM batches 2.2× the requests of Orca "
            "(Oracle) and 4.3× those of Orca (Max) (§6.2, Fig. 13a).\n\n")
    rows, ratios = _rates_table(results)
    share = {s: r for s, r in ratios.items() if "sharegpt" in s and s != "throughput"}
    agree = ("no ShareGPT panel yet." if not share else
             "on ShareGPT, vLLM / Orca (Oracle) per panel " + against({MODEL[s]: r["orca_oracle"] for s, r in share.items()},
                                                                   1.7, 2.7, "{:.2f}×")
             + "; vLLM / Orca (Max) " + against({MODEL[s]: r["orca_max"] for s, r in share.items()}, 2.7, 8.0, "{:.2f}×")
             + "; vLLM / FasterTransformer " + against({MODEL[s]: r["fastertransformer"] for s, r in share.items()},
                                                      1.0, 22.0, "{:.1f}×") + " (paper: up to 22×).")
    alpaca = {s.replace("alpaca", "sharegpt"): r for s, r in ratios.items() if "alpaca" in s}
    smaller = [s for s in alpaca if s in share and alpaca[s]["orca_oracle"] < share[s]["orca_oracle"]]
    smallest = [name for name, by in (("ShareGPT", share), ("Alpaca", alpaca)) if by and "opt175b" in
                min(by, key=lambda s: by[s]["orca_oracle"])]
    host = _host_share(results)
    fig13_table, fig13_text = _fig13(results)
    return head + "\n".join(rows) + f"""

Figures, one per panel (left: Fig. 12, normalized latency; middle and right: Fig. 13's two batch sizes, below),
from `<config>.json` beside this file. Each point's JSON entry also holds vLLM's benchmark metrics (TTFT,
TPOT, E2E percentiles), throughputs, preemptions, both batch sizes over the whole run and the steady state,
its wall time and its provenance.

{figures(*((f"{stem}.png", f"Figs. 12/13: {label}") for stem, label in PANELS))}

Agreement, per value: {agree} On Alpaca the advantage over Orca (Oracle) is smaller than on ShareGPT for
{len(smaller)} of {len([s for s in alpaca if s in share])} models (paper: smaller on Alpaca): vLLM / Orca (Oracle) on Alpaca
""" + ", ".join(f"{MODEL[s]} {r['orca_oracle']:.2f}×" for s, r in alpaca.items()) + f"""; it is smallest for OPT-175B on
{" and ".join(smallest) or "neither dataset"} (paper: smallest for OPT-175B).

### Fig. 13: what "batched requests" counts

Two definitions, both time-weighted over the run's executed steps (`jpaged/paper/metrics.py`,
`BatchOccupancyAccumulator`): *requests resident in the KV cache* = requests holding KV blocks on the GPU while
a step runs, computed in it or not (the batch the memory manager sustains); *requests per step* = requests with
at least one token computed in the step (the batch the GPU sees; under the paper's scheduler a prompt-only step
counts only its new prompts). At the paper's operating points (OPT-13B, one A100-40GB, 1 h ShareGPT / 10 min
Alpaca traces):

{fig13_table}

{fig13_text}

### Batch limits per panel

`max_num_seqs` is 256 in every panel: vLLM's default engine argument, and the paper states no other. Memory
binds first wherever the pool holds fewer requests than that (memory-bound resident requests: KV slots over a
request's mean context, `sim_validation.json`); only OPT-175B on Alpaca would hold more, so there the cap binds,
and `configs/throughput_opt175b_alpaca_seqs1024.yaml` reruns it at 1024 (its sensitivity row in the table above).

{_limits(results)}

### FasterTransformer and the chatbot: the readings we made

- FasterTransformer's batch size B, "as large as possible according to the GPU memory capacity" (§6.1): we read
  B as one constant per experiment at which no batch can run out of memory, i.e. B requests of the maximum length
  (prompt + output = 2,048): B = slots // 2,048 = 7 (OPT-13B), 4 (OPT-66B), 29 (OPT-175B);
  `jpaged/paper/baselines/request_level.py`. Alternatives: B sized per batch from the batch's own longest request
  (FasterTransformer allocates its buffers per call, so a batch of short requests could be larger — but then B is
  not a constant and a batch of long requests can exceed memory), or B sized from the mean length (the same
  problem, more often). The paper's wording (a maximum batch size set per experiment) and FasterTransformer's
  contract (a batch runs to completion without preemption) fit only the first.
- FasterTransformer's host time: the fitted host line models vLLM's Python runtime (scheduling, input preparation,
  sampling and output processing per step; ../shared/data/vidur_a100/cpu_overheads.csv). FasterTransformer is a
  C++ runtime whose decoding loop enqueues each step's kernels asynchronously ahead of the GPU and samples on
  the GPU; its per-step host work (a few kernel launches, one read-back of the finished flags) hides behind GPU
  time. So it pays none (`SimConfig.fastertransformer_host_overhead: none`); the sensitivity row "FasterTransformer
  pays vLLM's host line" in the table above bounds the choice. The Orca variants are the paper's reimplementations in vLLM's
  Python engine and pay vLLM's line.
- The chatbot's conversation rounds: see Fig. 17.

Differences and why:
- Absolute rates are lower than the pre-fit simulator's (see "Which figures moved"): the measured host work per
  sequence makes steps of large batches slow, which caps memory-rich panels below their memory bound.
- vLLM's advantage on Alpaca is below the paper's "similar trend": vLLM's Alpaca batches near its knee
  (""" + _alpaca_batches(results) + """ requests resident) lie past the host line's measured range (batch 8–64, extrapolated linearly), and """ + host + """: the extra
  requests vLLM's memory admits add little throughput. Whether paper-era vLLM's host work kept growing linearly past batch 64 is not in the data.
- OPT-175B's ratios fall below the paper's ShareGPT range: its 60K slots let the Orca variants hold large batches
  too, and at large batches steps are host-bound (TP 8 uses the TP 4 host line, the largest measured), so
  vLLM's extra memory buys less throughput.
- FasterTransformer's curve is not monotone at the lowest rates: a request arriving during a batch waits for the
  whole batch, so its latency depends on which batch it hits.
- Traces are shorter than the paper's 1 h except OPT-13B ShareGPT (wall-time budget here); above the knee
  latency grows with trace length, so the knee is slightly softer."""
