"""REPORT.md section beyond the paper: a fleet of simulated replicas behind round-robin and
sglang-router's cache-aware rule; sustained rate and prefix-hit rate vs replicas, and what a
replica whose tensor-parallel group spans servers pays per step."""

from __future__ import annotations

from experiments.markdown import Figures, command, finished, not_run, rate_cell

POLICY = {"round_robin": "round-robin", "cache_aware": "cache-aware"}
WORKLOAD = {"shared_prefix": "shared prefixes", "multi_turn": "multi-turn"}


def fleet_section(results: dict, figures: Figures) -> str:
    """The section: what is modelled and from what, what runs for real, the tables, the figure and
    what the numbers show, every number read from results/fleet.json."""
    head = ("## Beyond the paper — a fleet of replicas behind a router (simulated)\n\nQuestion (issue 33, item 5): "
            "past one machine, how do R replicas behind a router scale, and does routing by cached prefix "
            "(sglang-router's cache-aware policy) beat round-robin on workloads that share prefixes? The paper "
            "serves one replica; this section has no claim of its to compare with.\n\n")
    r = finished(results, "fleet", "sustained")
    if r is None:
        return head + not_run("fleet")
    cfg = r["provenance"]["config"]
    return head + "\n\n".join([_setup(r, cfg), *(_table(r, cfg, d) for d in cfg["deployments"]),
                               figures(("fleet.png", "Sustained rate and prefix-cache hits vs replicas, per policy")),
                               _findings(r, cfg), _cross_host(r, cfg)])


def _setup(r: dict, cfg: dict) -> str:
    sp, mt, router, link = cfg["shared_prefix"], cfg["multi_turn"], cfg["router"], cfg["link"]
    deployments = "; ".join(f"`{d['name']}`: {d['model']} on {d['tp']}× {d['gpu']} in {d['hosts']} server(s), "
                            f"{d['num_blocks'] - 1} KV blocks of {cfg['cache']['block_size']} per replica"
                            for d in cfg["deployments"])
    tree = max((p["router_tree_tokens"] for p in r["points"]), default=0)
    return f"""Command: {command("fleet")} ({r['run_wall_s']:.0f} s wall, {r['run_cpu_s']:.0f} s CPU on this run's
points). Deployments: {deployments}. Replicas R = {', '.join(map(str, cfg['replicas']))}; each curve's rates are R × the
deployment's per-replica grid, stopped after the first point past the threshold.

What is **modelled**, and from what:
- Step times: every replica's steps are priced by the cost model every simulated figure here uses
  (`jpaged/paper/sim/cost_model.py`, constants fitted on Vidur's measurements of vLLM on A100s).
- A replica spanning servers (`jpaged/paper/sim/interconnect.py`): NCCL's ring runs through the servers'
  adapters, one {link['adapter_bw'] * 8 / 1e9:.0f} Gb/s HDR InfiniBand adapter per GPU ({link['adapters_per_host']} per server,
  the DGX A100 datasheet); the ring's bus bandwidth is the smaller of NVLink's measured 192 GB/s and the adapters'
  line rate × {link['efficiency']} (NVIDIA/nccl#1048: 86 of 96 GB/s between two 8× A100 servers), and each all-reduce
  pays {link['latency_s'] * 1e6:.0f} µs more per extra server (NVIDIA/nccl-tests#150: 19–20 µs for small all-reduces
  between two A100 servers over HDR), added on top of the measured in-server floor.
- The router (`jpaged/paper/sim/routing.py`): sglang-router's `cache_aware` rule
  (sgl-router/src/policies/cache_aware.rs and tree.rs): when loads (requests routed and unfinished) are
  imbalanced, max − min > {router['balance_abs_threshold']} and max > {router['balance_rel_threshold']} × min, the
  least-loaded replica; otherwise the longest match in the router's own tree of the prompts it sent, if above
  {router['cache_threshold']} of the prompt, goes to the replica that used it last, else to the replica with the
  smallest tree. Our tree holds token ids in {router['block_size']}-token blocks (sglang's: characters) and does not
  evict (the largest tree here held {tree:,} tokens; sglang's default bound is 2^26 characters). Round-robin takes the
  replicas in turn. The router decides instantly; the network between it and the replicas costs nothing.
- Workloads: shared prefixes, {sp['num_prefixes']} prefixes of {sp['prefix_len']} tokens with Zipf({sp['zipf_s']})
  popularity (an assumption) + LogNormal task inputs (median {sp['input_median']:.0f}) and outputs (median
  {sp['output_median']:.0f}); multi-turn, ShareGPT-shaped conversations (Geometric, mean {mt['mean_turns']:.0f} turns,
  ended before the {cfg['scheduler']['max_model_len']}-token context; replies ≤ {mt['max_output_len']}), the user
  thinking Exponential({mt['think_mean_s']:.0f} s) between a reply and the next query (an assumption: ShareGPT has no
  timings). Warm-up is not measured: shared prefixes {sp['warmup_requests']} requests per replica (at least
  {sp['warmup_s']:.0f} s), multi-turn {mt['warmup_s']:.0f} s; then {sp['duration_s']:.0f} s / {mt['duration_s']:.0f} s
  of measured arrivals.

What is **real**: each replica is a jpaged `LLMEngine` whose scheduler ({cfg['scheduler']['policy']} policy), block
manager and prefix cache (radix tree over blocks, LRU eviction) run on every request; one event loop
(`jpaged/paper/sim/fleet.py`) orders all replicas' steps, arrivals and finishes on one virtual clock, and a
conversation's next turn carries the reply its replica produced. Hit rate = prompt tokens served from the replicas'
prefix caches / prompt tokens admitted, over the measured window."""


def _table(r: dict, cfg: dict, d: dict) -> str:
    by = r["sustained"][d["name"]]
    workloads = [w for w in WORKLOAD if w in by]
    head = "| R | " + " | ".join(f"{WORKLOAD[w]}: round-robin | cache-aware | ratio | hits RR → CA" for w in workloads)
    rows = [head + " |", "|---" * (1 + 4 * len(workloads)) + "|"]
    for n in map(str, cfg["replicas"]):
        cells = []
        for w in workloads:
            rr, ca = by[w]["round_robin"][n], by[w]["cache_aware"][n]
            cells.append(f"{rate_cell(rr['rate'], rr['censored'])} | {rate_cell(ca['rate'], ca['censored'])} | "
                         f"{ca['rate'] / rr['rate']:.2f}× | {100 * rr['prefix_hit_rate']:.0f}% → "
                         f"{100 * ca['prefix_hit_rate']:.0f}%")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    return (f"`{d['name']}`, sustained rate (req/s, the whole fleet) and hits at that rate:\n\n" + "\n".join(rows))


def _followups_by_prefix(r: dict, name: str) -> float | None:
    """Of the follow-up turns cache-aware routed in a deployment's multi-turn points, the fraction
    sent by prefix match (first turns never match: their tokens are new)."""
    points = [p for p in r["points"] if p["deployment"] == name and p["workload"] == "multi_turn"
              and p["policy"] == "cache_aware" and p["replicas"] > 1]
    followups = sum(p["followups_routed"] for p in points)
    return sum(p["decisions"].get("prefix_match", 0) for p in points) / followups if followups else None


def _findings(r: dict, cfg: dict) -> str:
    top, lines, beyond = str(max(cfg["replicas"])), [], []
    for d in cfg["deployments"]:
        by = r["sustained"][d["name"]]
        for w in (w for w in WORKLOAD if w in by):
            rr, ca = by[w]["round_robin"], by[w]["cache_aware"]
            one = rr["1"]["rate"] if "1" in rr else None
            scale = (f"; against {top} × one replica: round-robin {rr[top]['rate'] / (int(top) * one):.2f}, "
                     f"cache-aware {ca[top]['rate'] / (int(top) * one):.2f}") if one else ""
            lines.append(
                f"- `{d['name']}`, {WORKLOAD[w]}: at R = {top} cache-aware sustains {ca[top]['rate'] / rr[top]['rate']:.2f}× "
                f"round-robin's rate{scale}. Hits at the sustained rate {100 * rr[top]['prefix_hit_rate']:.0f}% "
                f"(round-robin) vs {100 * ca[top]['prefix_hit_rate']:.0f}% (cache-aware); at the lowest rate swept "
                f"{100 * rr[top]['light_load_hit_rate']:.0f}% vs {100 * ca[top]['light_load_hit_rate']:.0f}%.")
            if one:
                beyond += [rr[n]["rate"] / (int(n) * one) for n in rr if n != "1"]
                below = min(ca[top]["rate"], rr[top]["rate"]) / (int(top) * one)
                if below < 0.9:
                    lines.append(f"  Below {top} × one replica ({below:.2f}): one replica gets every turn of its "
                                 f"conversations back (hits {100 * rr['1']['prefix_hit_rate']:.0f}% at its sustained rate), "
                                 "and its point rests on the fewest requests.")
            if w == "multi_turn" and ca[top]["light_load_hit_rate"] > ca[top]["prefix_hit_rate"] + 0.2:
                preempted = max(p["num_preemptions"] for p in r["points"] if p["deployment"] == d["name"]
                                and p["workload"] == w and p["replicas"] == int(top))
                lines.append(f"  Cache-aware keeps a conversation where its history is cached, but by the sustained rate "
                             f"the pools ({d['num_blocks'] - 1} blocks a replica) are full of running conversations "
                             f"(up to {preempted} preemptions in a point at R = {top}) and reclaim a finished turn's "
                             "blocks before its next turn arrives, so both policies saturate alike: affinity needs "
                             "room for histories beyond the GPU pool (a host tier).")
        share = _followups_by_prefix(r, d["name"])
        if share is not None:
            lines.append(f"- `{d['name']}`, multi-turn: cache-aware sent {100 * share:.0f}% of follow-up turns by prefix "
                         "match; the rest fell to the smallest tree, because the router's tree holds the prompts it "
                         "sent, not the replies, so a turn whose previous reply outweighs its history is matched on "
                         f"at most {cfg['router']['cache_threshold']} of its prompt.")
    if beyond and max(beyond) > 1.05:
        lines.append(f"- Round-robin reaches up to {max(beyond):.2f}× R × one replica's rate: every R-th request of a "
                     "Poisson stream arrives more regularly than a Poisson stream (less queueing at the same load), "
                     "and the one-replica points rest on the fewest requests.")
    return ("What the numbers show (marks: `+` still under the threshold at the top of the sweep, `−` over it at the "
            "bottom):\n\n" + "\n".join(lines))


def _cross_host(r: dict, cfg: dict) -> str:
    costs = r.get("step_costs_ms", {})
    if not costs:
        return ""
    rows = ["| deployment | step | as deployed (ms) | of it all-reduce | one NVLink domain (ms) | of it all-reduce |",
            "|---|---|---|---|---|---|"]
    for name, steps in costs.items():
        for step, how in steps.items():
            cross, one = how["cross_host"], how["one_nvlink_domain"]
            rows.append(f"| `{name}` | {step.replace('_', ' ')} | {sum(cross.values()):.1f} | "
                        f"{cross['communication']:.1f} | {sum(one.values()):.1f} | {one['communication']:.1f} |")
    return ("What crossing servers costs a step (the cost model's parts; \"one NVLink domain\" prices the same GPUs as "
            "if NVLink joined them all, which no A100 server does past 8; decode: 64 sequences of 1024 tokens, prefill: "
            "one 1024-token prompt):\n\n" + "\n".join(rows))
