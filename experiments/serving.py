"""Machinery shared by the serving sweeps of Figs. 14-19: one measured point, a resumable sweep,
and the memory-saving meter of Fig. 15.

A sweep is a list of points (dicts) keyed by a tuple of their fields (e.g. system, rate, width).
After every point the partial results are written atomically, so an interrupted sweep resumes
past its finished points, provided the settings that shape a point (the config without its
sweep lists and output paths) are unchanged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Hashable, Iterable

import numpy as np
from tqdm.auto import tqdm

from experiments.common import write_json
from jpaged.block_manager import BlockManager
from jpaged.engine import LLMEngine
from jpaged.metrics import summarize_requests
from jpaged.trace_runner import TraceResult

logger = logging.getLogger(__name__)

Key = tuple[Hashable, ...]


def point_metrics(result: TraceResult) -> dict:
    """The paper's and vLLM's metrics of one served trace (keys as in results/throughput.json)."""
    summary = summarize_requests(result.records)
    return {"normalized_latency": summary.pop("normalized_latency_s"),
            "avg_batched_requests": result.avg_batched_requests,
            "num_preemptions": result.num_preemptions, "num_rejected": result.num_rejected,
            "num_steps": result.num_steps, "end_time_s": result.end_time_s, "wall_s": result.wall_s, **summary}


def run_sweep(path: Path, settings: dict, keys: Iterable[Key], key_of: Callable[[dict], Key],
              run_one: Callable[[Key], dict], provenance: dict, desc: str) -> list[dict]:
    """Points for every key in `keys`: those in `path` made with the same `settings` are kept, the
    rest run through `run_one(key)`; the partial JSON is rewritten after each point."""
    keys = list(keys)
    points = [p for p in _previous_points(path, settings) if key_of(p) in set(keys)]
    done = {key_of(p) for p in points}
    todo = [k for k in keys if k not in done]
    bar = tqdm(todo, desc=desc, disable=not todo)
    for key in bar:
        bar.set_postfix_str(" ".join(map(str, key)), refresh=True)
        point = run_one(key)
        points.append(point)
        bar.set_postfix_str(f"{' '.join(map(str, key))} norm_lat={point['normalized_latency']:.3f} "
                            f"wall_s={point['wall_s']:.1f}")
        write_json(path, {"points": points, "settings": settings, "provenance": provenance})
    return sorted(points, key=lambda p: keys.index(key_of(p)))


def _previous_points(path: Path, settings: dict) -> list[dict]:
    if not path.exists():
        return []
    previous = json.loads(path.read_text())
    if previous.get("settings") != json.loads(json.dumps(settings)):
        logger.warning("%s was made with other settings: starting the sweep afresh", path)
        return []
    return previous.get("points", [])


def sharing_counts(bm: BlockManager, seq_ids: Iterable[int]) -> tuple[int, int]:
    """(blocks in use, blocks needed without sharing) of the resident sequences `seq_ids`.

    In use = distinct physical blocks their tables reference (refcount > 0); without sharing every
    sequence would hold its own copy of each block of its table.
    """
    rows = np.fromiter((bm.row_of(s) for s in seq_ids if bm.has_seq(s)), dtype=np.int64)
    if rows.size == 0:
        return 0, 0
    counts = bm.num_table_blocks[rows]
    blocks = bm.block_tables[rows, : int(counts.max())][np.arange(int(counts.max()))[None, :] < counts[:, None]]
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
