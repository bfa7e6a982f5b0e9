"""REPORT.md section beyond the paper: speculative decoding on the paper's GPUs, modelled. The
verify step against vLLM's measured one, tok/s vs batch size, and the batch size above which
speculation stops paying (the basis of a `disable_by_batch_size` threshold)."""

from __future__ import annotations

from experiments.markdown import Figures, command, finished, not_run

DATASETS = {"sharegpt": "ShareGPT", "alpaca": "Alpaca"}
SCORERS = {"mqa": "multi-query scorer", "batch_expansion": "batch expansion"}


def spec_sim(results: dict, figures: Figures) -> str:
    """The section: what is modelled and from what, the verify step against measurement, the figure,
    the crossover table and the verdict, every number read from results/spec_sim.json."""
    head = ("## Beyond the paper — speculative decoding on the paper's GPUs (simulated)\n\nQuestion: on the "
            "paper's GPUs, at which batch sizes does speculative decoding raise output tok/s, and above which batch "
            "size does it stop paying — the measured basis for a `disable_by_batch_size`-style threshold? The paper "
            "has no speculation; this section has no claim of its to compare with.\n\n")
    r = finished(results, "spec_sim", "panels")
    if r is None:
        return head + not_run("spec_sim")
    cfg = r["provenance"]["config"]
    return head + "\n\n".join([_setup(r, cfg), _anchor(r, cfg), _growth(r, cfg),
                               figures(("spec_sim.png", "Speculative decoding: output tok/s vs batch size, modelled")),
                               _table(r, cfg), _verdict(r, cfg)])


def _label(p: dict) -> str:
    return f"{p['model'].upper()}, {p['tp']}× {p['gpu'].upper()}, {DATASETS.get(p['dataset'], p['dataset'])}"


def _span(values: list[float], fmt: str = "{:.2f}") -> str:
    """"lo–hi" of the values, or the one value when they agree at `fmt`."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _rows(p: dict, proposer: str | None = None, k: int | None = None, a: float | None = None) -> list[dict]:
    """The panel's crossover rows matching the given proposer, k and acceptance (None: any)."""
    return [c for c in p["crossovers"] if proposer in (None, c["proposer"]) and k in (None, c["k"])
            and a in (None, c["acceptance"])]


def _cross(c: dict, r: dict) -> str:
    return str(c["crossover_batch"]) if c["crossover_batch"] else f"> {r['settings']['max_search_batch']}"


def _describe(proposer: dict) -> str:
    if proposer["draft_model"] is None:
        return f"**{proposer['name']}** (prompt lookup) drafts with no device time, its host search taken as free"
    if proposer["draft_host"] == "measured":
        return (f"**{proposer['name']}** is {proposer['draft_model'].upper()} on the pool's GPU, k decode steps of it "
                "per speculative step, each paying vLLM's measured host line as when every draft step is a "
                "model-runner call")
    return (f"**{proposer['name']}** is {proposer['draft_model'].upper()} with its steps' host time removed (a draft "
            "loop kept on the device)")


def _setup(r: dict, cfg: dict) -> str:
    panels = "; ".join(f"{_label(p)} (`{p['panel']}`: {p['kv_blocks']:,} blocks of {p['block_size']} per GPU, "
                       f"max_num_seqs {p['max_num_seqs']})" for p in r["panels"])
    contexts = ", ".join(f"**{n}** tokens for {DATASETS.get(d, d)}" for d, n in r["mean_decode_context"].items())
    first = r["panels"][0]
    tokens = " and ".join(" / ".join(f"{c['expected_tokens']:.2f}" for c in _rows(first, cfg["proposers"][0]["name"], k))
                          + f" at k = {k}" for k in cfg["ks"])
    rates = " / ".join(str(a) for a in cfg["acceptance_rates"])
    return f"""Command: {command("spec_sim")} ({r['wall_s']:.0f} s; the cost model only, no engine run). Results
`spec_sim.json` and `spec_sim.png`.

What is **modelled**, and from what:
- The deployments are Fig. 12 panels' (model, GPUs, tensor parallelism and KV pool read from each panel's
  config): {panels}.
- A steady decode batch of B sequences at the dataset's mean decode context, E[o (p + (o + 1)/2)] / E[o] over
  {cfg['length_samples']:,} sampled requests: {contexts}. Prefills are left out: this is the decode phase's throughput.
- Step times from the simulator's cost model (`jpaged/paper/sim/cost_model.py`, constants fitted on Vidur's
  measurements of vLLM on A100). A plain decode step is its decode step. The **verify step**
  (`jpaged/paper/sim/speculative.py`) is one target step whose rows each compute k + 1 query tokens (the last
  sampled token and the k drafts) over their context, like a chunked prefill of k + 1 tokens per sequence, with
  every query token through the LM head (each position's logits decide acceptance) and the context read through
  the paged kernel at the decode rows' cost. The host's work is the plain step's (vLLM's measured line at the
  model's TP degree): nothing is added for the rejection sampler or the proposals' bookkeeping.
- Drafting: {'; '.join(map(_describe, cfg['proposers']))}. A draft model's catching up on the tokens accepted in
  the previous step is left out.
- Acceptance: each drafted token accepted independently with rate a (Leviathan et al. 2023), so a sequence emits
  (1 − a^(k+1)) / (1 − a) tokens per step: {tokens} for a = {rates}. Output tok/s = B × that / step seconds.
- Memory: a sequence holds context + k slots at its peak plus, on average, (block size − 1) / 2 empty slots of its
  last block; the largest batch is the pool's slots over that, or the panel's `max_num_seqs` if smaller. A draft
  model shares the pool as vLLM splits it: its weights come out of it and each target block is paired with one
  of the draft's.
- Not modelled: mixed prefill/decode steps, per-sequence acceptance that varies, a speculation length chosen per
  step, CUDA graphs (the host line is the measured eager vLLM's)."""


def _anchor(r: dict, cfg: dict) -> str:
    anchor, rows = cfg["anchor"], r["anchor"]
    if not rows:
        return ""
    contexts = anchor["contexts"]
    cell = {(x["scorer"], x["batch"], x["context"]): x for x in rows}
    head = "| B | " + " | ".join(f"measured {SCORERS[s]} (ms) | " + " | ".join(f"model, context {c}" for c in contexts)
                                for s in SCORERS) + " |"
    lines = [head, "|---|" + "---|" * (len(SCORERS) * (1 + len(contexts)))]
    for b in anchor["batches"]:
        cells = []
        for s in SCORERS:
            cells.append(f"{cell[s, b, contexts[0]]['measured_ms']}")
            cells += [f"{cell[s, b, c]['model_ms_host_measured']:.1f} ({cell[s, b, c]['ratio_host_measured']:.2f}×)"
                      for c in contexts]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    ratios = lambda scorer, context, key="ratio_host_measured": [  # noqa: E731
        x[key] for x in rows if x["scorer"] == scorer and x["context"] == context]
    mqa = " and ".join(f"{_span(ratios('mqa', c))}× the measured one at context {c}" for c in contexts)
    expansion = _span([x["ratio_host_measured"] for x in rows if x["scorer"] == "batch_expansion"])
    return f"""**The verify step against measurement.** The only published A100 verify-step times we found are vLLM's
({anchor['source']}; k = {anchor['k']}; context and A100 model not stated). The model
({anchor['gpu'].upper()}, not fitted to them), beside them:

{chr(10).join(lines)}

The multi-query verify step, the one the sweep uses, is {mqa}, rising with B: the measured run
replays CUDA graphs and times the scorer alone, while the model charges vLLM's whole eager step on the host. With
no host time at all the model is {_span(ratios('mqa', contexts[0], 'ratio_host_none'))}× the measured scorer at
context {contexts[0]}. Batch expansion (vLLM's first scorer: k + 1 single-query rows per sequence) priced with a
scheduled sequence's host work per expanded row is {expansion}× the measured one: those rows do not cost that
much, so the sweep does not use it."""


def _verify_over_decode(p: dict, k: int) -> dict[int, float]:
    """Per batch, the panel's verify step at k over its plain decode step, from the step's parts."""
    total = lambda part: sum(v for key, v in part.items() if key not in ("k", "batch"))  # noqa: E731
    plain = {x["batch"]: total(x) for x in p["parts"] if x["k"] == 0}
    return {x["batch"]: total(x) / plain[x["batch"]] for x in p["parts"] if x["k"] == k}


def _ridges(r: dict) -> str:
    by_gpu = {p["gpu"]: p["gemm_ridge_tokens"] for p in r["panels"]}
    return ", ".join(f"{t:.0f} on an {gpu.upper()}" for gpu, t in by_gpu.items())


def _growth(r: dict, cfg: dict) -> str:
    first, k = r["panels"][0], max(cfg["ks"])
    ratio = _verify_over_decode(first, k)
    ngram = cfg["proposers"][0]["name"]
    batch1 = [c["speedup_batch_1"] for p in r["panels"] for c in _rows(p, ngram)]
    growth = ", ".join(f"{v:.2f}× at B = {b}" for b, v in ratio.items())
    return f"""**Throughput vs batch size.** Rows: panels; columns: a = {', '.join(map(str, cfg['acceptance_rates']))};
line style by k; grey: more sequences than the KV pool holds.

The verify step costs what a decode step costs while the step is weight-bound, so at small batches speculation
multiplies tok/s by nearly the expected tokens per step ({ngram} at B = 1: {_span(batch1)}×). As B (k + 1)
approaches the GEMMs' ridge, the tokens per step at which their FLOPs take as long as reading their FP16 weights
(at the cost model's achieved FLOP/s and HBM bytes/s: {_ridges(r)}), the verify step grows faster than the
decode step: on {_label(first)} at k = {k} the verify step over the decode step is {growth}."""


def _table(r: dict, cfg: dict) -> str:
    rates = cfg["acceptance_rates"]
    lines = [f"| deployment | proposer | k | a = {rates[0]}: crossover / speedup at max B | "
             + " | ".join(f"a = {a}" for a in rates[1:]) + " | max B |", "|---|---|---|" + "---|" * (len(rates) + 1)]
    for p in r["panels"]:
        first = True
        for proposer in cfg["proposers"]:
            for k in cfg["ks"]:
                row = _rows(p, proposer["name"], k)
                cells = [(f"**{_cross(c, r)}**" if not c["pays_at_every_batch_that_fits"] else _cross(c, r))
                         + f" / {c['speedup_at_max_batch']:.2f}" for c in row]
                lines.append(f"| {_label(p) if first else ''} | {proposer['name']} | {k} | " + " | ".join(cells)
                             + f" | {row[0]['max_batch']} ({row[0]['max_batch_plain']}) |")
                first = False
    return f"""**Where speculation stops paying.** Crossover B: the smallest batch at which speculation's tok/s is no
higher than plain decoding's (searched over 1–{r['settings']['max_search_batch']}; "> {r['settings']['max_search_batch']}":
never). Max B: the largest batch that runs with speculation (without). Speedup at max B: speculation at its largest
batch over plain decoding at its own. Bold: a crossover at or below the largest batch that runs, where a
`disable_by_batch_size` threshold would act.

{chr(10).join(lines)}"""


def _panel_state(p: dict, cfg: dict, ngram: str) -> str:
    """A panel's largest batch against the ridge and what the verify step costs there."""
    k = max(cfg["ks"])
    cap = _rows(p, ngram, k)[0]["max_batch"]
    ratios = {k: _rows(p, ngram, k)[0]["verify_over_decode_at_max_batch"] for k in cfg["ks"]}
    cost = " to ".join(f"{v:.2f}× (k = {k})" for k, v in ratios.items())
    return (f"{_label(p)} holds {cap} sequences ({cap * (k + 1)} verify tokens at k = {k}, against a ridge of "
            f"{p['gemm_ridge_tokens']:.0f}), where the verify step costs {cost} a decode step")


def _verdict(r: dict, cfg: dict) -> str:
    ngram = cfg["proposers"][0]["name"]
    drafts = [q["name"] for q in cfg["proposers"][1:]]
    batch1 = "; ".join(f"{name} {_span([c['speedup_batch_1'] for p in r['panels'] for c in _rows(p, name)])}×"
                       for name in [ngram, *drafts])
    pays = [p for p in r["panels"] if all(c["pays_at_every_batch_that_fits"] for c in _rows(p, ngram))]
    stops = [p for p in r["panels"] if p not in pays]
    text = (f"**Verdict.** On the paper's A100s the verify step is nearly free while the decode step is weight-bound: "
            f"at batch 1 speculation multiplies tok/s by almost the expected tokens per step ({batch1}; a draft "
            "model's own steps cost most of the gap).")
    if pays:
        speedups = lambda p: _span([c["speedup_at_max_batch"] for c in _rows(p, ngram)])  # noqa: E731
        text += (f" Where the KV pool stops the batch near the GEMMs' ridge, {ngram} speculation pays at every batch "
                 "that fits, at every k and a modelled: " + "; ".join(
                     _panel_state(p, cfg, ngram) + f", and {ngram} gives {speedups(p)}× at the largest batch"
                     for p in pays) + ".")
    if stops:
        parts = []
        for p in stops:
            crossing = [c for c in _rows(p, ngram) if not c["pays_at_every_batch_that_fits"]]
            paying = [c for c in _rows(p, ngram) if c["pays_at_every_batch_that_fits"]]
            parts.append(_panel_state(p, cfg, ngram) + f"; {ngram} stops paying at " + ", ".join(
                f"B = {c['crossover_batch']} at k = {c['k']}, a = {c['acceptance']} ({c['speedup_at_max_batch']:.2f}× "
                "at the largest batch)" for c in crossing)
                + (f", while its other (k, a) still pay ({_span([c['speedup_at_max_batch'] for c in paying])}×)"
                   if paying else ""))
        text += (" It stops paying only where the pool lets B (k + 1) grow several times past the "
                 "ridge: " + "; ".join(parts) + ".")
    k, a = max(cfg["ks"]), min(cfg["acceptance_rates"])
    if drafts:
        text += (f" With a draft model, at k = {k} and a = {a}, the crossover B is: " + "; ".join(
            f"{name} " + ", ".join(f"{_cross(c, r)} ({p['model'].upper()}, {DATASETS.get(p['dataset'], p['dataset'])})"
                                    for p in r["panels"] for c in _rows(p, name, k, a)) for name in drafts) + ".")
    thresholds = []
    for q in cfg["proposers"]:
        bold = [c["crossover_batch"] for p in r["panels"] for c in _rows(p, q["name"])
                if not c["pays_at_every_batch_that_fits"]]
        rows = sum(len(_rows(p, q["name"])) for p in r["panels"])
        thresholds.append(f"{q['name']}, {len(bold)} of {rows} rows" + (f" (B = {_span(bold, '{}')})" if bold else ""))
    return text + f"""
Thresholds from the model, on the paper's GPUs: a `disable_by_batch_size` threshold acts only on the table's bold
rows — {'; '.join(thresholds)}; each row's threshold is its crossover. Two things make these crossovers late:
the cost model's host line (vLLM's eager Python loop of the paper's era, paid per sequence per step) and the KV
reads are per sequence, so speculation spreads them over more tokens, and a verify step whose host cost grows with
k, or a host loop as cheap as vLLM V1's, would move the crossovers earlier; and acceptance is i.i.d. at one rate for
every sequence, while real drafts are accepted unevenly, which lowers the tokens per step at the same mean rate."""
