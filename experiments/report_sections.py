"""The sections of results/REPORT.md: each takes every loaded result (file stem -> JSON) and the
report's `Figures`, and returns its markdown. Numbers are read from the results; the prose says
why they differ. This module: the shared helpers, Fig. 2, the engine's speed and host overhead;
report_simulator.py: the simulator against measurements, and which figures moved;
report_throughput.py: Figs. 12/13; report_sharing.py: Figs. 14-17; report_ablations.py: Figs. 18-19
and chunked prefill."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from jpaged.paper.systems import LABELS

# The paper every claim cites; its sections and figures are named where a claim is quoted.
PAPER = ('Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", '
         "SOSP'23 (arXiv:2309.06180)")

ORCAS = ("orca_oracle", "orca_pow2", "orca_max")
# (result stem, panel label) of Figs. 12/13, in the paper's order.
PANELS = (("throughput_opt13b_sharegpt", "OPT-13B, 1×A100-40GB, ShareGPT"),
          ("throughput", "same, default config"),
          ("throughput_opt66b_sharegpt", "OPT-66B, 4×A100-40GB, ShareGPT"),
          ("throughput_opt175b_sharegpt", "OPT-175B, 8×A100-80GB, ShareGPT"),
          ("throughput_opt13b_alpaca", "OPT-13B, 1×A100-40GB, Alpaca"),
          ("throughput_opt66b_alpaca", "OPT-66B, 4×A100-40GB, Alpaca"),
          ("throughput_opt175b_alpaca", "OPT-175B, 8×A100-80GB, Alpaca"))


class Figures:
    """Markdown for the figure PNGs in the report's folder: an embedded image where the file exists
    (its name relative to REPORT.md, so results/quick/REPORT.md shows results/quick's PNGs)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def __call__(self, *names_and_captions: tuple[str, str]) -> str:
        """One image line per existing (file name, caption); a note when none exists."""
        shown = [f"![{caption}]({name})" for name, caption in names_and_captions if (self.folder / name).exists()]
        return "\n\n".join(shown) if shown else "*No figure yet: the command above draws it.*"


def command(name: str, config: str | None = None) -> str:
    """The experiment's command line, as inline code."""
    return f"`python -m experiments.{name} --config configs/{config or name}.yaml`"


def not_run(name: str, config: str | None = None) -> str:
    """What a section says when its result is missing: the command that makes it."""
    return f"*Not run yet: {command(name, config)}.*"


def span(values: list[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    """ "lo–hi" of `values` as formatted ("x" when both ends format alike)."""
    lo, hi = min(values), max(values)
    return (fmt.format(lo) + unit) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}{unit}"


def against(values: dict[str, float], lo: float, hi: float, fmt: str = "{:.1f}") -> str:
    """Each labelled value placed against the paper's range [lo, hi], value by value (never a
    range against a range): "2 of 3 within 1.7–2.7 (a 1.8, b 2.1); below: c 1.3"."""
    inside = {k: v for k, v in values.items() if lo <= v <= hi}
    below = {k: v for k, v in values.items() if v < lo}
    above = {k: v for k, v in values.items() if v > hi}
    show = lambda d: ", ".join(f"{k} {fmt.format(v)}" for k, v in d.items())  # noqa: E731
    parts = [f"{len(inside)} of {len(values)} within {fmt.format(lo)}–{fmt.format(hi)}" + (f" ({show(inside)})" if inside else "")]
    parts += [f"below: {show(below)}"] * bool(below) + [f"above: {show(above)}"] * bool(above)
    return "; ".join(parts)


def finished(results: dict, stem: str, key: str) -> dict | None:
    """The result `stem` if its run finished (it has `key`; a sweep in progress holds only points)."""
    r = results.get(stem)
    return r if r is not None and key in r else None


def rate_cell(rate: float, censored: str | None) -> str:
    """A sustained rate, marked + (still under the threshold at the top of the sweep) or − (over it at the bottom)."""
    return f"{rate:.2f}" + {"above_sweep": "+", "below_sweep": "−"}.get(censored or "", "")


def header(results: dict, figures: Figures) -> str:
    return f"""# jpaged results against the paper

The paper: {PAPER}.

Each section: the paper's claim (naming the section or figure it comes from; "our reading": numbers
we read off its text and plots), our numbers and figure, the command that made them, and where and
why the two differ. This file is generated: `python -m experiments.report` (or
`python -m experiments.reproduce_all`) rewrites it from the JSON results beside it, so every number
below comes from a committed result; file names without a folder are beside this file, and the last
section lists which runs (git sha, date) computed each file's points. All serving figures are
**simulated** unless a section says otherwise: the scheduler, block manager and baseline allocators run for
real; only step times come from the cost model (`jpaged/paper/sim/cost_model.py`), whose constants are fitted on
measurements of vLLM on A100 GPUs, never on the paper's figures (next section). Systems are built by
`jpaged/paper/systems.py`; every paper-figure config runs the paper's scheduler (`scheduler.policy: paper`).
Sustained rate = where normalized latency crosses 4× the sweep's lowest, interpolated (`+`: still under it at
the highest rate swept; `−`: over it at the lowest). Agreement sentences place each of our values against the
paper's range, value by value."""


def memory_waste(results: dict, figures: Figures) -> str:
    head = "## Fig. 2 — KV cache memory waste\n\nClaim (§1, Fig. 2): existing systems store token states in only " \
           "20.4%–38.2% of the KV cache; vLLM wastes under 4% (averages over the §6.2 experiment).\n\n"
    r = results.get("memory_waste")
    if r is None:
        return head + not_run("memory_waste")
    steady = r.get("steady_state", {})
    runs = r.get("runs", {})
    rows = ["| system | window | token states | reserved | internal frag. | external frag. | free | warm-up (s) |",
            "|---|---|---|---|---|---|---|---|"]
    for system, whole in r["systems"].items():
        for window, v in (("whole run", whole), ("steady state", steady.get(system))):
            if v is None:
                continue
            warm = runs.get(system, {}).get("warmup_s")
            rows.append(f"| {LABELS[system]} | {window} | " + " | ".join(
                f"{v[k]:.1f}" for k in ("token_states", "reserved", "internal", "external", "free"))
                + f" | {'' if warm is None else f'{warm:.0f}'} |")
    orca = {LABELS[s]: v["token_states"] for s, v in r["systems"].items() if s != "vllm"}
    orca_steady = {LABELS[s]: v["token_states"] for s, v in steady.items() if s != "vllm"}
    waste = {w: v["reserved"] + v["internal"] for w, v in (("whole run", r["systems"].get("vllm")),
                                                          ("steady state", steady.get("vllm"))) if v is not None}
    cfg = r["provenance"]["config"]
    return head + f"""Command: {command("memory_waste")}. Setup: {cfg["model"]["name"]}, {cfg["sim"]["tp"]}× {cfg["sim"]["gpu"]},
{cfg["dataset"]} at {cfg["request_rate"]} req/s for {cfg["duration_s"]:.0f} simulated seconds, the same trace for every
system; time-averaged percent of the slot space (`memory_waste.json`) in two windows (`jpaged/paper/metrics.py`):
*whole run* = every executed step, weighted by its duration; *steady state* = from the first step during which
the pool was full (a preemption, or a waiting request held back for lack of KV memory) to the end, leaving out
the warm-up while the pool first fills (its length is the last column).

{chr(10).join(rows)}

{figures(("memory_waste.png", "Fig. 2: KV slot breakdown per system, whole run and steady state"),
         ("memory_waste_pool.png", "The block pool over a window of the run: which request owns each block"))}

Agreement, per value: Orca token states, whole run: {against(orca, 20.4, 38.2)}; steady state:
{against(orca_steady, 20.4, 38.2)} (paper 20.4–38.2%). vLLM's waste (reserved + internal): """ + "; ".join(
        f"{w} {x:.1f}%" for w, x in waste.items()) + """ (paper < 4%). Definitions (`jpaged/paper/kv_usage.py`): a sequence writes K/V for
its first final_len − 1 positions; *reserved* = allocated slots it will still write, *internal* = allocated
slots nobody will write (Orca's over-reservation and the buddy's rounding; vLLM's slots of a sequence's final
block past its end), *external* = free slots in buddy blocks smaller than the region the head of the waiting
queue needs. vLLM's waste is the unfilled tail of each sequence's current last block, which that sequence will
still fill; its free share is the admission watermark plus the gap left when the next request needs more blocks
than are free — not fragmentation, since any free block serves any request""" + (
        f"; leaving out the warm-up, it is {steady['vllm']['free']:.1f}% instead of {r['systems']['vllm']['free']:.1f}%"
        if "vllm" in steady and "vllm" in r["systems"] else "") + """. Orca's external fragmentation is similar for every policy: the pool is not a multiple of
the largest region, and the remainder serves no maximum-length reservation."""


def real_executor(results: dict, figures: Figures) -> str:
    out = "## Simulator speed\n\nRequirement: one simulated hour of OPT-13B on ShareGPT at 2 req/s in at most 20 s here.\n"
    r = results.get("throughput_opt13b_sharegpt")
    point = next((p for p in r["points"] if p["system"] == "vllm" and p["request_rate"] == 2.0), None) if r else None
    out += (f"Measured: {point['wall_s']:.2f} s wall ({point['completed']:,} requests, {point['num_steps']:,} steps) — the "
            "`vllm` point at 2.0 req/s of `throughput_opt13b_sharegpt.json` (`wall_s`), on the shared 2-core "
            "machine." if point else not_run("throughput", "throughput_opt13b_sharegpt"))
    out += "\n\n## Real executor through the same path\n\n"
    r = results.get("throughput_tiny_jax")
    if r is None:
        return out + not_run("throughput", "throughput_tiny_jax")
    n = r["provenance"]["config"].get("num_requests")
    return out + (f"{command('throughput', 'throughput_tiny_jax')} serves {n} Alpaca-shaped requests per system with "
                  f"{r['provenance']['config']['model']['name']} (dummy weights) via `executor: jax` on "
                  f"{r['provenance'].get('device', '?')} (`throughput_tiny_jax.json`, {r['total_wall_s']:.0f} s of "
                  "serving). Its latencies are wall times and only show the path works. "
                  "`tests/paper/baselines/test_contiguous.py::test_real_model_tokens_match_vllm` checks that Orca's contiguous "
                  "regions give the same greedy tokens as vLLM's paged blocks.\n\n"
                  + figures(("throughput_tiny_jax.png", "The real executor's sweep (wall-clock latencies)")))


def host_and_real_engine(results: dict, figures: Figures) -> str:
    """Host overhead per sequence-step, and the real engine against static batching on this CPU."""
    out = "## Host overhead and the real engine on this CPU\n\n"
    b = results.get("bench_host")
    if b is None:
        out += not_run("bench_host") + "\n\n"
    else:
        runs = b.get("runs") or [{**b, "policy": "(one run, before the two policies)"}]  # older files: one run
        rows = ["| policy | steps | sequence-steps | wall µs / sequence-step | CPU µs / sequence-step | preemptions |",
                "|---|---|---|---|---|---|"]
        for run in runs:
            cpu = run.get("cpu_us_per_seq_step")
            rows.append(f"| {run['policy']} | {run['steps']:,} | {run['seq_steps']:,} | {run['us_per_seq_step']:.2f} | "
                        f"{'—' if cpu is None else f'{cpu:.2f}'} | {run['num_preemptions']:,} |")
        out += (f"{command('bench_host')}: {b['num_requests']:,} ShareGPT-shaped requests at once at the OPT-13B / "
                "A100-40GB budget, no model, prefix caching and swap on; the scheduler, block manager, StepPlan arrays "
                "and token bookkeeping together, per scheduling policy:\n\n" + "\n".join(rows) + "\n\n")
    peer = results.get("bench_host_peer")
    if peer is not None:
        out += _peer(peer) + "\n\n"
    configs = [k for k in ("cpu_vs_vllm", "cpu_vs_vllm_bf16", "cpu_vs_vllm_bf16_pressure") if k in results]
    if configs:
        out += _against_vllm(configs, [results[k] for k in configs]) + "\n\n"
    r = results.get("serve_real")
    if r is None:
        return out + not_run("serve_real")
    cfg = r["provenance"]["config"]
    return out + (f"{command('serve_real')}: {cfg['num_requests']} ShareGPT-shaped requests (lengths x {cfg['length_scale']}) on "
                  f"{cfg['model']['name']} (dummy weights, {cfg['model']['dtype']}) on {r['provenance'].get('device', '?')}, "
                  f"the same {r['kv_slots']:,} KV slots for both: the paged engine makes **{r['paged_tok_s']:.0f} output "
                  f"tok/s**, static batching over a contiguous cache (batches of {cfg['baseline_batch_size']}, each run to "
                  f"its longest request) {r['baseline_tok_s']:.0f} tok/s: **{r['ratio']:.1f}x** (target >= "
                  f"{r['target_ratio']:.0f}x). Greedy outputs differ for {r['outputs_differ']} of {cfg['num_requests']} "
                  f"requests; compilations: {r['paged_compilations']} (paged), {r['baseline_compilations']} (static). "
                  "Each system runs the workload twice and the second, compiled run is timed. The gap comes from the "
                  "rows static batching keeps computing after their request ended and from its smaller batches.")


def _peer(peer: dict) -> str:
    """bench_host_peer's interleaved comparison with nano-vllm's scheduler: CPU time per sequence-step."""
    summary = peer["summary"]
    sizes = sorted({int(k.split("@")[1]) for k in summary})
    engines = [e for e in dict.fromkeys(k.split("@")[0] for k in summary) if e != "nanovllm"]
    rows = ["| block size | nano-vllm (CPU µs) | " + " | ".join(f"{e} (CPU µs, ratio)" for e in engines) + " |",
            "|---|---|" + "---|" * len(engines)]
    faster = []
    for size in sizes:
        cells = [f"{summary[f'nanovllm@{size}']['cpu_us_per_seq_step']:.2f}"]
        for e in engines:
            row = summary.get(f"{e}@{size}")
            cells.append("—" if row is None else f"{row['cpu_us_per_seq_step']:.2f} ({row['cpu_ratio']:.2f}×)")
            if row is not None:
                faster.append(row["cpu_ratio"] < 1)
        rows.append(f"| {size} | " + " | ".join(cells) + " |")
    load = ", ".join(f"{x:.1f}" for x in peer.get("load_average", []))
    cfg = peer["provenance"]["config"]
    return (f"{command('bench_host_peer')}: the same trace through nano-vllm's Scheduler + BlockManager "
            f"(../shared/bench, outside this repository) and through jpaged, {cfg['rounds']} interleaved rounds of "
            f"fresh processes per block size, medians of the per-round ratios (jpaged / nano-vllm, CPU time per "
            f"sequence-step; load average {load}):\n\n" + "\n".join(rows)
            + f"\n\njpaged is faster than the peer in {sum(faster)} of {len(faster)} cells (target: all, with prefix "
              "caching on).")


def _against_vllm(configs: list[str], runs: list[dict]) -> str:
    """cpu_vs_vllm's alternating runs of jpaged and vLLM's CPU build (one result per config name in
    `configs`): tokens per wall- and CPU-second."""
    rows = ["| dtype | KV slots | tok / wall-s (jpaged, vLLM) | wall ratio | tok / CPU-s (jpaged, vLLM) | CPU ratio | "
            "identical greedy tokens | close (vLLM's test) | load |", "|---|---|---|---|---|---|---|---|---|"]
    ahead = []
    cpus = sorted({r["provenance"].get("cpu", "a CPU the file does not name") for r in runs})
    for r in runs:
        for c in r["conditions"]:
            s = c["summary"]
            loads = [run["load_average_before"][0] for engine in ("jpaged", "vllm") for run in c["runs"][engine]]
            close = f"{s['close_requests']}/{r['num_requests']}" if "close_requests" in s else "-"
            rows.append(f"| {c['dtype']} | {c['kv_slots']:,} | {s['jpaged']['tok_per_wall_s']:.0f}, "
                        f"{s['vllm']['tok_per_wall_s']:.0f} | {s['ratio_wall']:.2f} | {s['jpaged']['tok_per_cpu_s']:.0f}, "
                        f"{s['vllm']['tok_per_cpu_s']:.0f} | {s['ratio_cpu']:.2f} | {s['identical_requests']}/"
                        f"{r['num_requests']} | {close} | {min(loads):.1f}-{max(loads):.1f} |")
            ahead += [s["ratio_wall"] >= 1, s["ratio_cpu"] >= 1]
    return (f"{', '.join(command('cpu_vs_vllm', c) for c in configs)}: the real engine against vLLM's CPU build on one local "
            "Hugging Face directory (opt-125m, dummy weights), serve_real's requests, greedy, jpaged then vLLM in fresh "
            f"processes each round, on {' / '.join(cpus)}, medians of the per-round ratios (jpaged / vLLM; load: the "
            "1-minute load average before each run, on 2 cores; close: the greedy outputs agree, or at their first "
            "difference each engine's token is among the other's top 5, vLLM's `check_logprobs_close`; "
            "docs/ARCHITECTURE.md, CPU path, has the loaded runs, why bf16 is judged by closeness, and how to read "
            "vLLM's CPU seconds):\n\n" + "\n".join(rows)
            + f"\n\njpaged is at least as fast as vLLM in {sum(ahead)} of {len(ahead)} cells (target: all).")


def provenance(results: dict, figures: Figures) -> str:
    """Per result file: the runs that computed it, from its points' own provenance where they carry
    one (points kept by `--resume` keep theirs), else the file's (one run for the whole file)."""
    rows = ["| result | computed by (git sha, date: points) | device | jax |", "|---|---|---|---|"]
    for stem, r in sorted(results.items()):
        prov = r.get("provenance", {})
        stamps = [p["provenance"] for p in r.get("points", []) + r.get("rows", []) if "provenance" in p]
        runs = Counter((s.get("git_sha", "?")[:12], s.get("date", "?")[:10]) for s in stamps or [prov])
        who = ", ".join(f"`{sha}` {date}" + (f": {n}" if stamps else " (file)") for (sha, date), n in runs.items())
        real = r.get("real_provenance")  # preemption's real-executor rows, kept from an earlier run
        if real:
            who += f"; its real-executor rows: `{real.get('git_sha', '?')[:12]}` {real.get('date', '?')[:10]} on {real.get('device', '?')}"
        rows.append(f"| `{stem}.json` | {who} | {prov.get('device', '?')} | {prov.get('jax', prov.get('jax_version', '?'))} |")
    return ("## Provenance\n\n" + "\n".join(rows) + "\n\n(file): the file carries no per-point provenance; the sha "
            "and date are those of the run that wrote it, which, for a sweep written before points carried their own, "
            "may have kept points computed by earlier runs.")
