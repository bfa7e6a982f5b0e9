"""Which paper figures moved against the previous committed results, by how much, and why.

Each figure's headline numbers (sustained rates, batch sizes, KV shares, memory savings, latencies)
are read from the results of a previous commit (`git show <before>:results/<name>.json`), from
today's results/, and, where it exists, from an attribution run: today's code and scheduler with
the pre-fit cost model (configs/attribution/), so that a move splits into the part the scheduler
made (previous -> attribution) and the part the cost model made (attribution -> today). How close
the attribution's cost model is to the pre-fit model is measured too: both models' step times on
the same batches, the old one loaded from `jpaged/paper/sim/cost_model.py` at `old_cost_model_rev`.
REPORT.md's "Which figures moved and why" renders results/figure_moves.json.

    python -m experiments.report.figure_moves --config configs/figure_moves.yaml
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.config import load_config
from jpaged.paper.systems import LABELS

logger = logging.getLogger(__name__)

Results = dict[str, dict]  # result stem -> parsed JSON
Extractor = Callable[[Results], dict[str, float]]  # quantity -> value (absent quantities left out)


@dataclasses.dataclass(frozen=True)
class FigureMovesConfig:
    """The previous commit to compare with, and where the pre-fit cost model lives."""

    before: str = "ff24d9a"  # the commit whose results/ are "the previous results"
    old_cost_model_rev: str = "fe10aba"  # a commit holding the pre-fit jpaged/paper/sim/cost_model.py
    attribution_config: str = "configs/attribution/throughput.yaml"  # whose sim.cost approximates it
    output: str = "results/figure_moves.json"


PANELS = {"throughput": "Fig. 12(a) 10 min", "throughput_opt13b_sharegpt": "Fig. 12(a)",
          "throughput_opt66b_sharegpt": "Fig. 12(b)", "throughput_opt175b_sharegpt": "Fig. 12(c)",
          "throughput_opt13b_alpaca": "Fig. 12(d)", "throughput_opt66b_alpaca": "Fig. 12(e)",
          "throughput_opt175b_alpaca": "Fig. 12(f)"}
FIG13 = (("throughput_opt13b_sharegpt", 2.0), ("throughput_opt13b_alpaca", 30.0))  # the paper's operating points


def _sustained(r: dict | None, prefix: str, by: dict | None = None) -> dict[str, float]:
    by = by if by is not None else (r or {}).get("sustained_rate", {})
    return {f"{prefix} {LABELS.get(s, s)} sustained (req/s)": v for s, v in by.items()}


def throughput_panels(res: Results) -> dict[str, float]:
    out = {}
    for stem, fig in PANELS.items():
        out |= _sustained(res.get(stem), fig)
    return out


def fig13(res: Results) -> dict[str, float]:
    """Both batch sizes at the paper's Fig. 13 points (older files: requests per step only)."""
    out = {}
    for stem, rate in FIG13:
        for p in (res.get(stem) or {}).get("points", []):
            if p["request_rate"] == rate and p["system"] != "fastertransformer":
                where = f"Fig. 13 {'ShareGPT' if 'sharegpt' in stem else 'Alpaca'} {rate:g} req/s {LABELS[p['system']]}"
                out[f"{where} requests per step"] = p.get("requests_per_step", p["avg_batched_requests"])
                if "requests_resident" in p:
                    out[f"{where} requests resident"] = p["requests_resident"]
    return out


def fig2(res: Results) -> dict[str, float]:
    r = res.get("memory_waste")
    if r is None:
        return {}
    out = {f"Fig. 2 {LABELS[s]} token states (%)": v["token_states"] for s, v in r["systems"].items()}
    v = r["systems"]["vllm"]
    return out | {"Fig. 2 vLLM waste, reserved + internal (%)": v["reserved"] + v["internal"]}


def _series(key: str) -> str:
    """Today's series name of a Figs. 14/15 key (the previous results' "beam" was the synthetic model)."""
    return "beam_synthetic" if key == "beam" else key


def figs14_15(res: Results) -> dict[str, float]:
    r = res.get("parallel_sampling")
    if r is None or "memory_saving" not in r:
        return {}
    out = {}
    for d, by in r["memory_saving"].items():
        for series, widths in by.items():
            for w, v in widths.items():
                out[f"Fig. 15 {d} {_series(series)} width {w} memory saving (%)"] = v
    for key, by in r["sustained_rate"].items():
        d, rest = key.split(".")
        series = _series(rest.rstrip("0123456789"))
        out |= _sustained(None, f"Fig. 14 {d} {series} width {rest[len(rest.rstrip('0123456789')):]}", by)
    return out


def fig16(res: Results) -> dict[str, float]:
    r = res.get("shared_prefix")
    return {k: v for n, by in (r or {}).get("sustained_rate", {}).items() for k, v in _sustained(None, f"Fig. 16 {n}-token prefix", by).items()}


def fig17(res: Results) -> dict[str, float]:
    return _sustained(res.get("chatbot"), "Fig. 17")


def fig18b_19b(res: Results) -> dict[str, float]:
    out = {}
    for p in (res.get("block_size") or {}).get("points", []):
        if p["block_size"] in (16, 128):
            out[f"Fig. 18b {p['dataset']} at {p['request_rate']:g} req/s, block {p['block_size']} (s/token)"] = \
                p["normalized_latency"]
    for p in (res.get("preemption") or {}).get("points", []):
        if p["block_size"] in (1, 16, 256):
            out[f"Fig. 19b {p['mode']}, block {p['block_size']} (s/token)"] = p["normalized_latency"]
    return out


def chunked_prefill(res: Results) -> dict[str, float]:
    return _sustained(res.get("chunked_prefill"), "chunked prefill")


EXTRACTORS: tuple[Extractor, ...] = (fig2, throughput_panels, fig13, figs14_15, fig16, fig17, fig18b_19b,
                                     chunked_prefill)
# Attribution runs: today's code with the pre-fit cost model, read as if they were these results.
ATTRIBUTION = {"attribution_throughput": "throughput", "attribution_shared_prefix": "shared_prefix",
               "attribution_parallel_sampling": "parallel_sampling"}


def results_at(rev: str | None) -> Results:
    """results/*.json at commit `rev` (git show), or in the working tree when `rev` is None."""
    if rev is None:
        return {p.stem: json.loads(p.read_text()) for p in sorted((REPO_ROOT / "results").glob("*.json"))}
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:results"], cwd=REPO_ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    return {Path(n).stem: json.loads(subprocess.run(["git", "show", f"{rev}:results/{n}"], cwd=REPO_ROOT,
                                                    capture_output=True, text=True, check=True).stdout)
            for n in names if n.endswith(".json")}


def headline(res: Results) -> dict[str, float]:
    """Every figure's headline numbers."""
    out: dict[str, float] = {}
    for extract in EXTRACTORS:
        out |= extract(res)
    return out


def old_cost_model_agreement(config: FigureMovesConfig) -> dict:
    """Step-time ratios on decode batches and single prompts of each paper model: the attribution's
    cost model / the pre-fit model at `old_cost_model_rev` ("ratio": how faithful the attribution is),
    and today's fitted model / the pre-fit model ("fitted_ratio": how much slower steps became)."""
    from experiments.throughput import ThroughputConfig
    from jpaged.config.presets import get_preset
    from jpaged.paper.sim.cost_model import CostModel
    from jpaged.paper.sim.gpus import get_gpu

    source = subprocess.run(["git", "show", f"{config.old_cost_model_rev}:jpaged/paper/sim/cost_model.py"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "old_cost_model.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("old_cost_model", path)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_cost_model"] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
    cost = load_config(REPO_ROOT / config.attribution_config, ThroughputConfig).sim.cost
    rows = []
    for name, tp, gpu in (("opt-13b", 1, "a100-40gb"), ("opt-66b", 4, "a100-40gb"), ("opt-175b", 8, "a100-80gb")):
        model, g = get_preset(name), get_gpu(gpu)
        before, after = old.CostModel(model, g, old.CostModelConfig(), tp=tp), CostModel(model, g, cost, tp=tp)
        fitted = CostModel(model, g, tp=tp)
        for batch, context in ((1, 100), (8, 300), (32, 300), (128, 100), (256, 80)):
            ctx = np.full(batch, context)
            rows.append({"model": name, "kind": "decode", "batch": batch, "tokens": context,
                         "ratio": after.decode_time(ctx) / before.decode_time(ctx),
                         "fitted_ratio": fitted.decode_time(ctx) / before.decode_time(ctx)})
        for q in (20, 160, 1000, 2000):
            lens = np.array([q])
            rows.append({"model": name, "kind": "prompt", "batch": 1, "tokens": q,
                         "ratio": after.prefill_time(lens, lens) / before.prefill_time(lens, lens),
                         "fitted_ratio": fitted.prefill_time(lens, lens) / before.prefill_time(lens, lens)})
    del sys.modules["old_cost_model"]
    return {"rev": config.old_cost_model_rev, "rows": rows}


def _computed_by(res: Results) -> dict[str, list[str]]:
    """Per result file: the git shas its points (or the file) were computed at."""
    out = {}
    for stem, r in res.items():
        stamps = [p["provenance"] for p in r.get("points", []) + r.get("rows", []) if "provenance" in p]
        out[stem] = sorted({s.get("git_sha", "?")[:12] for s in stamps or [r.get("provenance", {})]})
    return out


def run(config: FigureMovesConfig) -> dict:
    """Writes results/figure_moves.json: per quantity, before / attribution / after."""
    before, after = results_at(config.before), results_at(None)
    attribution = {target: after[stem] for stem, target in ATTRIBUTION.items() if stem in after}
    old, new, mid = headline(before), headline(after), headline(attribution)
    rows = [{"quantity": q, "before": old.get(q), "attribution": mid.get(q), "after": new.get(q)}
            for q in dict.fromkeys([*old, *new])]
    sha = subprocess.run(["git", "rev-parse", config.before], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    result = {"before": {"rev": sha, "computed_by": _computed_by(before)}, "rows": rows,
              "attribution_files": sorted(ATTRIBUTION), "old_cost_model": old_cost_model_agreement(config),
              "provenance": provenance(config)}
    write_json(REPO_ROOT / config.output, result)
    moved = [r for r in rows if r["before"] and r["after"] and abs(r["after"] / r["before"] - 1) > 0.1]
    print(f"{len(rows)} quantities, {len(moved)} moved by more than 10%")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], FigureMovesConfig, run, "configs/figure_moves.yaml")
