"""Ablations of a paper figure: the figure rerun with one modelling choice changed at a time.

An ablation config names a figure experiment (`experiment`: throughput, chatbot, shared_prefix or
parallel_sampling), the committed config it starts from (`base`), the fields every run changes to
keep the grid small (`common`: shorter traces, fewer rates around the knees; the baseline row runs
with them too, so each variant is compared with a baseline of the same grid) and the variants. A
variant sets dotted fields of the figure's config (`set`: {"scheduler.max_num_batched_tokens":
2560}); with `systems` it reruns only those systems and keeps the baseline's points of the others
(a rule of one system, e.g. how Orca batches). Each run is the figure's own `run(config)`, written
to ablation/<name>/<variant>.json beside `output` (and its figure), so every row keeps its points and
provenance; the quantities the figure is judged by (`quantities_of`: vLLM / Orca sustained-rate
ratios, or Fig. 15's memory saving) are recomputed from the merged points with the figure's own
sustained-rate rule and written, per variant, to `output`. A variant's `reading` says why it is
there: `source` (the paper, its artifact or vLLM v0.1.x fix the value; `why` cites the line),
`bound` (a plausible bound of a choice no source fixes) or `check` (a check of the ablation's own
method, e.g. the same row on another trace length; `compare_with` names the row it repeats, which
the table measures its change against instead of the baseline).

    python -m experiments.ablation --config configs/ablation/chatbot.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Literal

from experiments import common
from experiments.common import REPO_ROOT, call_run, provenance, write_json
from experiments.throughput import sustained_rates
from jpaged.config import config_to_dict, load_config
from jpaged.config.loading import config_from_dict
from jpaged.paper.systems import LABELS

logger = logging.getLogger(__name__)

# figure -> (module under experiments/, its config class)
FIGURES = {"throughput": ("throughput", "ThroughputConfig"), "chatbot": ("chatbot", "ChatbotConfig"),
           "shared_prefix": ("shared_prefix", "SharedPrefixConfig"),
           "parallel_sampling": ("parallel_sampling", "ParallelSamplingConfig")}
# Fields that change how a figure reads its points, not the points: a variant changing only these
# reuses the baseline's points.
_READ_ONLY = {"latency_threshold_factor"}
READINGS = ("source", "bound", "check")
# Result files of a figure run that the ablation redirects to ablation/<name>/ beside its own output.
_OUTPUT_FIELDS = ("output", "figure", "saving_figure")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One changed choice: dotted config fields and their values, and why they are plausible."""

    name: str  # row label, e.g. "max_num_batched_tokens 2560"
    set: dict[str, Any]  # dotted field of the figure's config -> value
    # source: fixed by a cited source; bound: a plausible bound; check: a check of the method
    reading: Literal["source", "bound", "check"] = "bound"
    why: str = ""  # the citation (source), the argument for the bound, or what the check checks
    systems: list[str] = dataclasses.field(default_factory=list)  # rerun only these; [] = every system
    compare_with: str = "baseline"  # the row this one's change is measured against (a check's twin)

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("variants[].name must be a non-empty string")
        if not self.set:
            raise ValueError(f"variants[{self.name}].set must change at least one field")
        if self.reading not in READINGS:
            raise ValueError(f"variants[{self.name}].reading must be one of {', '.join(READINGS)}, got {self.reading!r}")


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """A figure, the config it starts from, the changes every run shares, and the variants."""

    experiment: str  # the figure experiment whose run() computes each row (a FIGURES key)
    base: str  # the figure's committed config, relative to the repo root
    name: str  # folder of the rows' own results: ablation/<name>/ beside `output`
    common: dict[str, Any] = dataclasses.field(default_factory=dict)  # dotted field -> value, every run
    variants: list[Variant] = dataclasses.field(default_factory=list)
    readings: list[str] = dataclasses.field(default_factory=lambda: list(READINGS))  # which variants run
    # quantity -> [lo, hi] the paper prints (the verdict places each row against it)
    paper: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    columns: list[str] = dataclasses.field(default_factory=list)  # further quantities the table shows (no range)
    output: str = "results/ablation.json"  # the table's JSON, relative to the repo root

    def __post_init__(self) -> None:
        if self.experiment not in FIGURES:
            raise ValueError(f"experiment must be one of {', '.join(FIGURES)}, got {self.experiment!r}")
        if not re.fullmatch(r"[a-z0-9_]+", self.name):
            raise ValueError(f"name must be lower-case letters, digits and _, got {self.name!r}")
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names) or "baseline" in names:
            raise ValueError(f"variants[].name must be unique and not 'baseline', got {names}")
        for i, v in enumerate(self.variants):
            if v.compare_with != "baseline" and v.compare_with not in names[:i]:
                raise ValueError(f"variants[{v.name}].compare_with must name an earlier row, got {v.compare_with!r}")
        if not self.readings or set(self.readings) - set(READINGS):
            raise ValueError(f"readings must list some of {', '.join(READINGS)}, got {self.readings}")
        for quantity, bounds in self.paper.items():
            if len(bounds) != 2 or not 0 < bounds[0] <= bounds[1]:
                raise ValueError(f"paper.{quantity} must be [lo, hi] with 0 < lo <= hi, got {bounds}")


def set_fields(data: dict, changes: dict[str, Any]) -> dict:
    """A copy of the nested config dict `data` with each dotted field of `changes` set; a field the
    config does not have raises, naming it."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = out
        for i, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise ValueError(f"set: {dotted}: {'.'.join(parents[:i + 1])} is not a section of the config")
            node[part] = dict(node[part])  # copy on the way down: the base stays unchanged
            node = node[part]
        if leaf not in node:
            raise ValueError(f"set: {dotted}: the config has no field {leaf!r} there")
        node[leaf] = value
    return out


def figure_config(config: AblationConfig, row: str, changes: dict[str, Any], systems: list[str] | None = None):
    """The figure's config for one row: base + common + `changes`, outputs under ablation/<name>/."""
    module_name, class_name = FIGURES[config.experiment]
    cls = getattr(importlib.import_module(f"experiments.{module_name}"), class_name)
    data = set_fields(config_to_dict(load_config(REPO_ROOT / config.base, cls)), {**config.common, **changes})
    slug = re.sub(r"[^a-z0-9]+", "_", row.lower()).strip("_")
    folder = Path(config.output).parent / "ablation" / config.name  # beside the table's JSON
    for field in _OUTPUT_FIELDS:
        if field in data:
            suffix = "_saving.png" if field == "saving_figure" else (".json" if field == "output" else ".png")
            data[field] = str(folder / f"{slug}{suffix}")
    if systems:
        data["systems"] = list(systems)
    return config_from_dict(cls, data, f"{config.base} ({row})")


def quantities_of(figure: str, points: list[dict], fig_config) -> tuple[dict[str, float], dict[str, str]]:
    """The numbers the figure is judged by, from its points: vLLM / each other system's sustained
    rate (per prefix for shared_prefix), or the memory saving (%) per dataset, series and width;
    and, per quantity the sweep did not bracket, "above_sweep" or "below_sweep" (the figure's rule,
    `experiments.throughput.sustained_rates`)."""
    if figure == "parallel_sampling":  # and, for beam search, the distinct parents of each step's beams
        saving = {f"{p['dataset']} {p['series']} width {p['width']} saving (%)": p["memory_saving"]
                  for p in points if "memory_saving" in p}
        parents = {f"{p['dataset']} {p['series']} width {p['width']} parents per step": p["mean_parents_per_step"]
                   for p in points if "memory_saving" in p and "mean_parents_per_step" in p}
        return saving | parents, {}
    panels = ({"": points} if figure != "shared_prefix" else
              {f"{n}-token prefix: ": [p for p in points if p["prefix_len"] == n] for n in fig_config.prefix_lens})
    out, censored = {}, {}
    for label, panel in panels.items():
        systems = list(dict.fromkeys(p["system"] for p in panel))
        threshold = fig_config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
        rates = sustained_rates(panel, systems, threshold)
        for system in systems:
            name = f"{label}{LABELS[system]} sustained (req/s)"
            out[name] = rates[system]["rate"]
            if rates[system]["censored"]:
                censored[name] = rates[system]["censored"]
        for system in systems:
            if system != "vllm":
                name = f"{label}vLLM / {LABELS[system]}"
                out[name] = rates["vllm"]["rate"] / rates[system]["rate"]
                flags = {rates[s]["censored"] for s in ("vllm", system)} - {None}
                if flags:
                    censored[name] = "/".join(sorted(flags))
    return out, censored


def knees(figure: str, points: list[dict], fig_config) -> dict[str, dict]:
    """Per panel and system, its last point under the sustained threshold (the knee's loaded side):
    rate, requests resident in the KV cache and requests per step there; for Fig. 15, each saving
    run's preemptions (none: the swap space never came into play)."""
    if figure == "parallel_sampling":
        return {f"{p['dataset']} {p['series']} width {p['width']}": {"num_preemptions": p["num_preemptions"]}
                for p in points if "memory_saving" in p}
    panels = ({"": points} if figure != "shared_prefix" else
              {f"{n}-token prefix: ": [p for p in points if p["prefix_len"] == n] for n in fig_config.prefix_lens})
    out = {}
    for label, panel in panels.items():
        threshold = fig_config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
        for system in dict.fromkeys(p["system"] for p in panel):
            under = [p for p in panel if p["system"] == system and p["normalized_latency"] <= threshold]
            if under:
                p = max(under, key=lambda p: p["request_rate"])
                out[f"{label}{LABELS[system]}"] = {k: p[k] for k in ("request_rate", "requests_resident",
                                                                     "requests_per_step", "num_preemptions")}
    return out


def _row(config: AblationConfig, name: str, changes: dict, systems: list[str], run: Callable,
         baseline_points: list[dict] | None, resume: bool) -> dict:
    fig_config = figure_config(config, name, changes, systems)
    if baseline_points is not None and set(changes) <= _READ_ONLY:  # the baseline's points, read another way
        points = baseline_points
        return {"name": name, "set": changes, "systems": systems, "result": None,
                **dict(zip(("quantities", "censored"), quantities_of(config.experiment, points, fig_config))),
                "knees": knees(config.experiment, points, fig_config), "wall_s": 0.0}
    result = call_run(run, fig_config, resume=resume)
    points = result["points"]
    if systems and baseline_points is not None:  # the other systems keep the baseline's points
        points = [p for p in baseline_points if p["system"] not in systems] + points
    quantities, censored = quantities_of(config.experiment, points, fig_config)
    return {"name": name, "set": changes, "systems": systems, "result": fig_config.output,
            "quantities": quantities, "censored": censored, "knees": knees(config.experiment, points, fig_config),
            # the figure's own scalars (e.g. the chatbot's share of prompts at the cut)
            "scalars": {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            "wall_s": result["total_wall_s"]}  # its points' own wall time (kept points keep theirs)


def _table(config: AblationConfig, rows: list[dict], prov: dict) -> dict:
    return {"rows": rows, "paper": config.paper, "columns": config.columns, "experiment": config.experiment,
            "base": config.base, "common": config.common, "provenance": prov}


def run(config: AblationConfig, resume: bool = False) -> dict:
    """The baseline and every variant (each the figure's own run; under `resume`, each keeps its
    finished points); writes and returns the table's JSON."""
    module = importlib.import_module(f"experiments.{FIGURES[config.experiment][0]}")
    prov = provenance(config)
    rows = []
    baseline = _row(config, "baseline", {}, [], module.run, None, resume)
    base_points = json.loads((REPO_ROOT / baseline["result"]).read_text())["points"]
    rows.append(baseline | {"reading": "baseline", "why": f"{config.base} with the common changes"})
    out = REPO_ROOT / config.output
    for variant in (v for v in config.variants if v.reading in config.readings):
        print(f"== {config.name}: {variant.name}")
        row = _row(config, variant.name, variant.set, variant.systems, module.run, base_points, resume)
        rows.append(row | {"reading": variant.reading, "why": variant.why, "compare_with": variant.compare_with})
        write_json(out, _table(config, rows, prov))
    result = _table(config, rows, prov)
    write_json(out, result)
    for row in rows:
        print(f"{row['name']:<40} " + "  ".join(f"{q}: {v:.3g}" for q, v in row["quantities"].items()
                                                 if q in config.paper or not config.paper))
    return result


def main() -> None:
    """The command line: `python -m experiments.ablation --config configs/ablation/<figure>.yaml`."""
    logging.basicConfig(level=logging.WARNING)
    common.main(__doc__.splitlines()[0], AblationConfig, run, "configs/ablation/chatbot.yaml")
