"""Speculative decoding on the paper's A100s, modelled: decode throughput vs batch size with and without it.

For each Fig. 12 panel listed (by default the ShareGPT ones, OPT-13B on 1x A100-40GB, OPT-66B on
4x A100-40GB, OPT-175B on 8x A100-80GB, and OPT-13B on Alpaca's short requests; model, dataset,
GPUs, TP and KV pool read from the panel's config) the simulator's cost model
(jpaged/paper/sim/speculative.py) prices a steady batch of B sequences at the dataset's mean decode
context: plain decode steps (k = 0), and speculative steps of k drafted tokens per sequence, drafted
by each proposer (n-gram: no device work; a draft model: k decode steps of it), then verified in one
target step (one multi-query row per sequence, as vLLM's MQA scorer and V1 do). Output tok/s =
B x (1 - a^(k + 1)) / (1 - a) / step seconds at per-token acceptance a.
Per (panel, proposer, k, a): the crossover, the smallest batch at which speculation's tok/s is no
higher than plain decoding's (the measured basis for a `disable_by_batch_size` threshold), beside
the largest batch that runs (the KV pool's, each sequence holding its k drafted slots and a draft
model's KV and weights sharing the pool, or the panel's max_num_seqs if smaller) and the speedup there.
Beside them, the anchor: the modelled verify step against vLLM's published scoring times on an A100
(both of its scorers), with and without the host line, at contexts bracketing the unstated one.

    python -m experiments.spec_sim --config configs/spec_sim.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np
import yaml

from experiments import common, plots
from experiments.common import REPO_ROOT, provenance, write_json
from jpaged.config import config_from_dict
from jpaged.config.presets import dtype_itemsize, get_preset
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.speculative import (SpeculativeCostModel, expected_tokens, max_batch,
                                          pool_blocks_with_draft)
from jpaged.paper.workloads import sample_lengths

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Proposer:
    """One way of drafting: n-gram (no draft model) or a draft model priced by the cost model."""

    name: str  # label in the results and the figure
    draft_model: str | None = None  # preset of the draft model (tensor parallel 1, on the pool's GPU); None: n-gram
    # Host seconds of each draft step: measured = the vLLM host line the target's steps pay (TP 1),
    # as when every draft step is a model-runner call; none = a draft loop that stays on the device
    draft_host: Literal["measured", "none"] = "measured"


@dataclasses.dataclass(frozen=True)
class ScorerAnchor:
    """vLLM's measured verify-step ("scoring") times on an A100, to set the modelled verify step beside."""

    source: str = ""  # where the numbers were published
    model: str = "llama-7b"  # preset of the measured target model
    gpu: str = "a100-80gb"  # jpaged.paper.sim.gpus name of the measured GPU
    k: int = 5  # drafted tokens per sequence
    batches: list[int] = dataclasses.field(default_factory=list)  # sequences per step
    mqa_ms: list[float] = dataclasses.field(default_factory=list)  # measured multi-query scorer, per batch
    batch_expansion_ms: list[float] = dataclasses.field(default_factory=list)  # measured batch expansion, per batch
    contexts: list[int] = dataclasses.field(default_factory=lambda: [128, 512])  # modelled contexts (unstated there)

    def __post_init__(self) -> None:
        if not len(self.batches) == len(self.mqa_ms) == len(self.batch_expansion_ms) or not self.batches:
            raise ValueError("anchor.batches, anchor.mqa_ms and anchor.batch_expansion_ms must have one entry "
                             "per batch")


@dataclasses.dataclass(frozen=True)
class SpecSimConfig:
    """The panels, batch sizes, draft lengths, acceptance rates and proposers to model."""

    panels: list[str] = dataclasses.field(default_factory=lambda: [
        *(f"configs/throughput_{m}_sharegpt.yaml" for m in ("opt13b", "opt66b", "opt175b")),
        "configs/throughput_opt13b_alpaca.yaml"])  # model, dataset, GPUs, pool
    batches: list[int] = dataclasses.field(default_factory=lambda: [2**i for i in range(9)])  # figure's x, sequences
    ks: list[int] = dataclasses.field(default_factory=lambda: [2, 4])  # drafted tokens per sequence per step
    acceptance_rates: list[float] = dataclasses.field(default_factory=lambda: [0.5, 0.7, 0.9])  # per token, i.i.d.
    proposers: list[Proposer] = dataclasses.field(default_factory=lambda: [Proposer("ngram")])
    anchor: ScorerAnchor | None = None  # measured verify steps to compare the model with; None: none
    max_search_batch: int = 1024  # crossovers are searched over batches 1..this
    length_samples: int = 200_000  # sampled requests for the dataset's mean decode context
    seed: int = 0  # seeds the length samples
    output: str = "results/spec_sim.json"  # results JSON, relative to the repo root
    figure: str = "results/spec_sim.png"  # tok/s vs batch size, a row per panel, a column per acceptance rate

    def __post_init__(self) -> None:
        if not self.panels or not self.proposers:
            raise ValueError("panels and proposers must be non-empty")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be a non-empty list of integers >= 1, got {self.batches}")
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"ks must be a non-empty list of integers >= 1, got {self.ks}")
        if not self.acceptance_rates or not all(0.0 <= a < 1.0 for a in self.acceptance_rates):
            raise ValueError(f"acceptance_rates must be a non-empty list in [0, 1), got {self.acceptance_rates}")
        if len({p.name for p in self.proposers}) != len(self.proposers):
            raise ValueError(f"proposer names must be distinct, got {[p.name for p in self.proposers]}")
        if self.max_search_batch < max(self.batches):
            raise ValueError(f"max_search_batch must be >= the largest batch, got {self.max_search_batch}")
        if self.length_samples < 1000:
            raise ValueError(f"length_samples must be >= 1000, got {self.length_samples}")


def mean_decode_context(dataset: str, samples: int, seed: int) -> int:
    """The context a decode step sees on average over a dataset's requests, rounded to a token.

    A request of prompt p and output o runs o decode steps at contexts p + 1 .. p + o; over all
    steps alike: E[o (p + (o + 1) / 2)] / E[o].
    """
    prompt, output = sample_lengths(dataset, samples, np.random.default_rng(seed))
    return round(float((output * (prompt + (output + 1) / 2)).sum() / output.sum()))


def _panel(path: str) -> dict:
    """The served model, modelled GPUs and KV pool of a throughput panel's config."""
    data = yaml.safe_load((REPO_ROOT / path).read_text())
    sim = config_from_dict(SimConfig, data.get("sim", {}), source=path)
    return {"path": path, "model": data["model"]["name"], "dataset": data["dataset"], "sim": sim,
            "block_size": data["cache"]["block_size"], "max_num_seqs": data["scheduler"]["max_num_seqs"],
            "kv_blocks": data["cache"]["num_blocks"] - 1}  # block 0 is reserved (Table 1's slots exclude it)


def _models(panel: dict, proposer: Proposer) -> tuple[SpeculativeCostModel, int]:
    """The panel's speculative cost model with `proposer`, and the KV blocks left for sequences."""
    sim, bs = panel["sim"], panel["block_size"]
    gpu = get_gpu(sim.gpu)
    target = CostModel(get_preset(panel["model"]), gpu, sim.cost, tp=sim.tp, dtype=sim.dtype, block_size=bs)
    if proposer.draft_model is None:
        return SpeculativeCostModel(target), panel["kv_blocks"]
    cost = sim.cost if proposer.draft_host == "measured" else dataclasses.replace(
        sim.cost, host_overhead_s=0.0, host_overhead_per_seq_s=0.0)
    draft_spec = get_preset(proposer.draft_model)
    draft = CostModel(draft_spec, gpu, cost, tp=1, dtype=sim.dtype, block_size=bs)
    blocks = pool_blocks_with_draft(panel["kv_blocks"], target, draft, draft_spec.param_bytes(sim.dtype))
    return SpeculativeCostModel(target, draft), blocks


def gemm_ridge_tokens(panel: dict) -> float:
    """Tokens per step at which the GEMMs' FLOPs take as long as reading their weights once, at the
    cost model's achieved FLOP/s and HBM bytes/s: past it a verify step's k + 1 tokens per
    sequence cost more than a decode step's one."""
    sim, gpu = panel["sim"], get_gpu(panel["sim"].gpu)
    # 2 FLOPs per weight per token against the weight's bytes read once per step
    return (gpu.fp16_flops * sim.cost.tensor_core_efficiency * dtype_itemsize(sim.dtype)
            / (2.0 * gpu.hbm_bw * sim.cost.hbm_efficiency))


def run_panel(config: SpecSimConfig, panel: dict, context: int) -> dict:
    """Every curve, crossover and memory cap of one panel."""
    curves, crossovers = [], []
    plain, blocks0 = _models(panel, Proposer("none"))
    cap0 = min(max_batch(blocks0, panel["block_size"], context, 0), panel["max_num_seqs"])
    baseline = {b: plain.throughput(b, context, 0, 0.0) for b in config.batches}
    curves.append({"proposer": "none", "k": 0, "acceptance": None,
                   "tok_s": [baseline[b] for b in config.batches],
                   "step_s": [plain.step_time(b, context, 0) for b in config.batches]})
    # The plain step and the n-gram verify step by part at every batch: where the time goes as B grows.
    parts = [{"k": k, "batch": b, **plain.target.breakdown(np.full(b, k + 1, np.int32),
                                                             np.full(b, context + k, np.int32), verify=True)}
             for k in (0, *config.ks) for b in config.batches]
    for proposer in config.proposers:
        model, blocks = _models(panel, proposer)
        for k in config.ks:
            cap = min(max_batch(blocks, panel["block_size"], context, k), panel["max_num_seqs"])
            step = [model.step_time(b, context, k) for b in config.batches]
            for a in config.acceptance_rates:
                tok_s = [b * expected_tokens(a, k) / s for b, s in zip(config.batches, step)]
                curves.append({"proposer": proposer.name, "k": k, "acceptance": a, "tok_s": tok_s, "step_s": step,
                               "draft_s": [model.draft_time(b, context, k) for b in config.batches]})
                cross = model.crossover(context, k, a, config.max_search_batch)
                spec_at_cap = model.throughput(cap, context, k, a)
                plain_at_cap = plain.throughput(cap0, context, 0, 0.0)
                crossovers.append({
                    "proposer": proposer.name, "k": k, "acceptance": a, "expected_tokens": expected_tokens(a, k),
                    "crossover_batch": cross, "max_batch": cap, "max_batch_plain": cap0,
                    "pays_at_every_batch_that_fits": cross is None or cross > cap,
                    "speedup_batch_1": model.throughput(1, context, k, a) / plain.throughput(1, context, 0, 0.0),
                    "verify_over_decode_at_max_batch": model.verify_time(cap, context, k) / model.verify_time(
                        cap, context, 0),
                    "tok_s_at_max_batch": spec_at_cap, "plain_tok_s_at_max_batch": plain_at_cap,
                    "speedup_at_max_batch": spec_at_cap / plain_at_cap})
    return {"panel": panel["path"], "model": panel["model"], "gpu": panel["sim"].gpu, "tp": panel["sim"].tp,
            "dataset": panel["dataset"], "context": context, "kv_blocks": panel["kv_blocks"],
            "gemm_ridge_tokens": gemm_ridge_tokens(panel),
            "max_num_seqs": panel["max_num_seqs"],
            "block_size": panel["block_size"], "curves": curves, "crossovers": crossovers, "parts": parts}


def run_anchor(anchor: ScorerAnchor) -> list[dict]:
    """The modelled verify step (multi-query and batch expansion; with vLLM's host line and with none)
    beside the measured milliseconds, per batch and context."""
    spec, gpu = get_preset(anchor.model), get_gpu(anchor.gpu)
    targets = {"measured": CostModel(spec, gpu),
               "none": CostModel(spec, gpu, CostModelConfig(host_overhead_s=0.0, host_overhead_per_seq_s=0.0))}
    rows = []
    for i, batch in enumerate(anchor.batches):
        for context in anchor.contexts:
            for scorer, measured in (("mqa", anchor.mqa_ms[i]), ("batch_expansion", anchor.batch_expansion_ms[i])):
                row = {"batch": batch, "context": context, "scorer": scorer, "measured_ms": measured}
                for host, target in targets.items():
                    ms = 1e3 * SpeculativeCostModel(target, batch_expansion=scorer == "batch_expansion").verify_time(
                        batch, context, anchor.k)
                    row |= {f"model_ms_host_{host}": ms, f"ratio_host_{host}": ms / measured}
                rows.append(row)
    return rows


def plot(config: SpecSimConfig, panels: list[dict], dpi: int = 80) -> None:
    """tok/s vs batch size: a row per panel, a column per acceptance rate; beyond the largest batch
    that runs without speculation (grey) the points are the cost model's alone: those batches do not fit.
    `dpi` is below the other figures' because this one has a dozen panels of many lines, which
    stay readable at it at a fraction of the file size."""
    rates = config.acceptance_rates
    fig, axes = plt.subplots(len(panels), len(rates), figsize=(3.6 * len(rates), 3.0 * len(panels)), squeeze=False)
    colors = dict(zip([p.name for p in config.proposers], ("tab:blue", "tab:orange", "tab:green", "tab:purple")))
    styles = dict(zip(config.ks, ("--", "-", ":", "-.")))
    for row, result in zip(axes, panels):
        base = next(c for c in result["curves"] if c["proposer"] == "none")
        cap = result["crossovers"][0]["max_batch_plain"]
        for ax, a in zip(row, rates):
            ax.plot(config.batches, base["tok_s"], color="black", marker="o", ms=3, label="no speculation")
            for c in result["curves"]:
                if c["acceptance"] == a:
                    ax.plot(config.batches, c["tok_s"], color=colors[c["proposer"]], ls=styles[c["k"]],
                            label=f"{c['proposer']} k={c['k']}")
            if cap < max(config.batches):
                ax.axvspan(cap, max(config.batches), color="0.85", zorder=0)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{result['model']}, {result['tp']}x {result['gpu']}, {result['dataset']} "
                         f"(context {result['context']}), a = {a}", fontsize=7)
            ax.set_xlabel("Batch size (sequences)")
            ax.set_ylabel("Output tok/s")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle("Speculative decoding on the cost model: decode tok/s vs batch size; "
                 "grey: more sequences than the KV pool holds", fontsize=9)
    fig.tight_layout()
    plots.save(fig, REPO_ROOT / config.figure, dpi=dpi)


def markdown(result: dict) -> str:
    """The crossover table (per panel, proposer, k and a: where speculation stops paying) and, when
    there is one, the anchor table (modelled vs measured verify-step milliseconds)."""
    lines = ["| model (GPUs), dataset | proposer | k | a | tokens/step | speedup at B=1 | crossover B "
             "| max B (plain) | speedup at max B |", "|---|---|---|---|---|---|---|---|---|"]
    for p in result["panels"]:
        for c in p["crossovers"]:
            cross = c["crossover_batch"] or f"> {result['settings']['max_search_batch']}"
            lines.append(f"| {p['model']} ({p['tp']}x {p['gpu']}), {p['dataset']} | {c['proposer']} | {c['k']} "
                         f"| {c['acceptance']} | {c['expected_tokens']:.2f} | {c['speedup_batch_1']:.2f} | {cross} "
                         f"| {c['max_batch']} ({c['max_batch_plain']}) | {c['speedup_at_max_batch']:.2f} |")
    if result["anchor"]:
        lines += ["", "| scorer | batch | context | measured ms | model ms (host line) | model ms (no host) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['scorer']} | {r['batch']} | {r['context']} | {r['measured_ms']} "
                  f"| {r['model_ms_host_measured']:.1f} ({r['ratio_host_measured']:.2f}x) "
                  f"| {r['model_ms_host_none']:.1f} ({r['ratio_host_none']:.2f}x) |" for r in result["anchor"]]
    return "\n".join(lines)


def run(config: SpecSimConfig) -> dict:
    """Models every panel, writes the JSON and the figure, prints the crossover table; returns the JSON."""
    start = time.perf_counter()
    panels = [_panel(path) for path in config.panels]
    # datasets in the panels' order (not a set's), so the JSON and the report list them the same way every run
    contexts = {d: mean_decode_context(d, config.length_samples, config.seed)
                for d in dict.fromkeys(p["dataset"] for p in panels)}
    results = [run_panel(config, panel, contexts[panel["dataset"]]) for panel in panels]
    anchor = run_anchor(config.anchor) if config.anchor is not None else []
    result = {"panels": results, "mean_decode_context": contexts, "anchor": anchor,
              "settings": {"max_search_batch": config.max_search_batch},
              "wall_s": time.perf_counter() - start,
              "provenance": provenance(config, seed=config.seed, device="none (cost model of the A100s)")}
    write_json(REPO_ROOT / config.output, result)
    plot(config, results)
    print(f"mean decode context: {contexts}")
    print(markdown(result))
    logger.info("wrote %s and %s", config.output, config.figure)
    return result


def main() -> None:
    """The command line: `python -m experiments.spec_sim [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], SpecSimConfig, run, "configs/spec_sim.yaml")
