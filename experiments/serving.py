"""Machinery shared by the serving sweeps of Figs. 12-19: one measured point, a resumable sweep,
the memory-saving meter of Fig. 15 and the beam-branching meter beside it.

A sweep is a list of points (dicts) keyed by a tuple of their fields (e.g. system, rate, width).
Each point carries the provenance of the run that computed it (`point["provenance"]`: git sha,
date, library versions, device); the file's top-level provenance is the latest run's. After
every point the partial results are written atomically. A plain run computes every point; with
`resume=True` (an experiment's `--resume`) it keeps the points of the output file made with the
same settings (the config without its sweep lists and output paths), says how many it kept,
and computes the rest, so an interrupted sweep picks up where it stopped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Hashable, Iterable

import numpy as np
from tqdm.auto import tqdm

from experiments.common import point_provenance, write_json
from jpaged.core.kv.block_manager import BlockManager
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.paper.metrics import summarize_requests
from jpaged.paper.trace_runner import TraceResult

logger = logging.getLogger(__name__)

Key = tuple[Hashable, ...]


def point_metrics(result: TraceResult) -> dict:
    """The paper's and vLLM's metrics of one served trace (keys as in results/throughput.json)."""
    summary = summarize_requests(result.records)
    return {"normalized_latency": summary.pop("normalized_latency_s"),
            "avg_batched_requests": result.avg_batched_requests, **result.batch_sizes,
            "num_preemptions": result.num_preemptions, "num_rejected": result.num_rejected,
            "num_steps": result.num_steps, "end_time_s": result.end_time_s, "wall_s": result.wall_s, **summary}


def run_sweep(path: Path, settings: dict, keys: Iterable[Key], key_of: Callable[[dict], Key],
              run_one: Callable[[Key], dict], provenance: dict, desc: str, resume: bool = False) -> list[dict]:
    """Points for every key in `keys`, in that order, each computed by `run_one(key)` and stamped
    with this run's provenance; under `resume`, those already in `path` with the same `settings`
    (and a provenance of their own) are kept instead. The partial JSON is rewritten after each point."""
    keys = list(keys)
    points = reusable_points(path, settings, set(keys), key_of) if resume else []
    if resume:
        print(f"{desc}: reused {len(points)} of {len(keys)} points from {path} (--resume)")
    done = {key_of(p) for p in points}
    todo = [k for k in keys if k not in done]
    stamp = point_provenance(provenance)
    bar = tqdm(todo, desc=desc, disable=not todo)
    for key in bar:
        bar.set_postfix_str(" ".join(map(str, key)), refresh=True)
        point = run_one(key) | {"provenance": stamp}
        points.append(point)
        bar.set_postfix_str(f"{' '.join(map(str, key))} norm_lat={point['normalized_latency']:.3f} "
                            f"wall_s={point['wall_s']:.1f}")
        write_json(path, {"points": points, "settings": settings, "provenance": provenance})
    return sorted(points, key=lambda p: keys.index(key_of(p)))


def reusable_points(path: Path, settings: dict, keys: set[Key], key_of: Callable[[dict], Key]) -> list[dict]:
    """The points of `path` a resumed sweep may keep: made with `settings`, wanted (key in `keys`),
    and carrying the provenance of the run that computed them (older files lack it: recomputed)."""
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    if previous.get("settings") != json.loads(json.dumps(settings)):
        logger.warning("%s was made with other settings: starting the sweep afresh", path)
        return []
    points = [p for p in previous.get("points", []) if key_of(p) in keys]
    kept = [p for p in points if "provenance" in p]
    if len(kept) < len(points):
        logger.warning("%s: %d points carry no provenance of their own: computing them again", path,
                       len(points) - len(kept))
    return kept


def sharing_counts(bm: BlockManager, seq_ids: Iterable[int]) -> tuple[int, int]:
    """(blocks in use, blocks needed without sharing) of the resident sequences `seq_ids`.

    In use = distinct physical blocks their tables reference (refcount > 0); without sharing every
    sequence would hold its own copy of each block of its table.
    """
    store = bm.rows
    rows = np.fromiter((store.row_of(s) for s in seq_ids if store.has_seq(s)), dtype=np.int64)
    if rows.size == 0:
        return 0, 0
    counts = store.num_table_blocks[rows]
    blocks = store.block_tables[rows, : int(counts.max())][np.arange(int(counts.max()))[None, :] < counts[:, None]]
    used = np.unique(blocks)
    assert (bm.refcount[used] > 0).all(), "a block table references a free block"
    return len(used), int(counts.sum())


class SharingMeter:
    """Step observer: the time-weighted memory saving of sharing, 1 - used / unshared (Fig. 15).

    Each step weighs the block counts held while it ran (after scheduling, copy-on-write
    included) by its duration; the saving is 1 - sum(used * dt) / sum(unshared * dt).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.used_s = 0.0  # block-seconds in use
        self.unshared_s = 0.0  # block-seconds without sharing

    def __call__(self, start: float, plan) -> None:
        """Adds one executed step (called by run_trace after the step ran)."""
        scheduler = self.engine.scheduler
        seq_ids = [s.seq_id for g in scheduler.running for s in g.seqs]
        used, unshared = sharing_counts(scheduler.block_manager, seq_ids)
        dt = self.engine.executor.now() - start
        self.used_s += used * dt
        self.unshared_s += unshared * dt

    @property
    def saving(self) -> float:
        """Fraction of blocks saved by sharing over the run (0 when nothing ran)."""
        return 1.0 - self.used_s / self.unshared_s if self.unshared_s else 0.0


class BranchingMeter(EngineObserver):
    """Engine observer: where beam search branches. At every beam step after the first (the first
    forks a prompt into its beams), the width new beams of a group descend from some number P of
    distinct live beams; each parent with k children forks k - 1 times, so P = width - new forks.
    P = 1 is a collapse (every beam continues one parent: the others' blocks are freed and the
    survivors share the most); P = width means every beam kept exactly one child."""

    KEYS = ("mean_parents_per_step", "one_parent_step_fraction", "beam_steps")

    def __init__(self) -> None:
        self._before: dict[int, tuple] = {}  # id(group) -> (group, num_forks) at the step's start
        self.parents: list[int] = []  # P of every measured beam step

    def on_step_executed(self, engine, out, result, start, end) -> None:
        """Notes the fork count of every beam group that samples past its first token in this step."""
        rows = out.plan.sampling
        self._before = {} if rows is None else {
            id(s.group): (s.group, s.group.num_forks) for s in rows.seqs
            if s.group.sampling_params.use_beam_search and s.num_output_tokens > 0}

    def on_step_end(self, engine, out, outputs, end) -> None:
        """Counts each noted group's distinct parents from the forks the step made."""
        for group, forks in self._before.values():
            self.parents.append(group.sampling_params.n - (group.num_forks - forks))
        self._before = {}

    def summary(self) -> dict[str, float]:
        """{mean distinct parents per beam step, fraction of beam steps with one parent, beam steps}."""
        parents = np.asarray(self.parents, np.float64)
        if parents.size == 0:
            return {"mean_parents_per_step": 0.0, "one_parent_step_fraction": 0.0, "beam_steps": 0}
        return {"mean_parents_per_step": float(parents.mean()), "one_parent_step_fraction": float((parents == 1).mean()),
                "beam_steps": int(parents.size)}
