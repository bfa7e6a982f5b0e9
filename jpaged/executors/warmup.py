"""Every program a config can need, compiled before the first request, and the disk cache behind them.

`grid(config, vocab)` lists the programs the engine can produce under `config`, derived from the
padding rules the scheduler and executor use (jpaged.core.padding) and the config's limits:

- model steps: decode (T == S, M bucketed to the longest table) and steps with a prompt chunk
  (T, S a power of two, M the full width), every padded shape the token, sequence and block budgets
  allow (`padding.decode_shapes`, `padding.prefill_shapes`);
- sampler programs (jpaged.executors.sampling; three calls whose variants add up): for each
  step's S, the choice (`DrawVariant`) in every draw mode a batch of at most S rows can produce
  (8 with two rows: draw_mode's 13, those with a top_k above 64 run as the widest; 5 with one), with and without processed
  logits; the top candidates (`TopVariant`) at each width of the ladder `sampling.top_width` up to
  what `logprobs` (MAX_LOGPROBS) and beam search (2 x n, n up to max_num_seqs) ask; the controls
  (`ControlsVariant`) of penalties alone at each history width of `padding.control_width` up to
  max_model_len. Other control combinations (logit_bias, banned tokens, allowed tokens, several
  at once) compile on first use: the executor counts them and logs each;
- block operations: copy-on-write pair arrays (at most one copy per running sequence a step) and,
  under swap preemption with a host pool, swap-out and swap-in pair arrays.

A new static variant of any stage is one more family in `grid`. `compile_grid` runs each program
once on padding (padded tokens write only to the reserved block 0; swaps move block 0), so the
executor's `num_compilations` afterwards equals the grid's size and serving compiles nothing more.
`enable_compilation_cache` keeps compiled programs on disk (`$JPAGED_CACHE_DIR/jax`, default
~/.cache/jpaged/jax): a restart then traces and loads them instead of compiling.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.core import padding
from jpaged.core.sampling_controls import SamplingControls
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.core.step_plan import SamplingBatch, StepPlan
from jpaged.executors import sampling
from jpaged.executors.sampling import ControlsVariant, DrawVariant, SamplerProgram, TopVariant, top_width

if TYPE_CHECKING:
    from jpaged.executors.jax import JaxExecutor

log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/jpaged"
# Programs that compile faster than this are not written to the disk cache: reading an entry back
# costs a few milliseconds, and the smallest eager operations compile in about that.
MIN_CACHED_COMPILE_S = 0.05


@dataclasses.dataclass(frozen=True)
class ModelStep:
    """One padded shape of the jitted model step."""

    kind: str  # "decode" (one token per sequence, T == S) or "prefill" (a step with a prompt chunk)
    num_tokens: int  # T
    num_seqs: int  # S
    table_width: int  # M


@dataclasses.dataclass(frozen=True)
class BlockOp:
    """One padded size of a block operation's pair array."""

    op: str  # "copy_blocks", "swap_out" or "swap_in"
    num_pairs: int


Program = ModelStep | SamplerProgram | BlockOp


def model_steps(config: EngineConfig) -> list[ModelStep]:
    """Every padded model-step shape the scheduler can build under `config`."""
    sched, cache = config.scheduler, config.cache
    max_blocks = -(-sched.max_model_len // cache.block_size)  # the block table's full width
    decode = padding.decode_shapes(sched.max_num_seqs, max_blocks)
    prefill = padding.prefill_shapes(sched.max_num_seqs, sched.max_num_batched_tokens, max_blocks)
    return [ModelStep("decode", *shape) for shape in decode] + [ModelStep("prefill", *shape) for shape in prefill]


# Random rows whose settings reach every draw mode (jpaged.executors.draw.draw_mode): (top_k, top_p)
# as a candidate width (16, 64), the full-vocabulary top-k (above 64) and top-p; a mode needs at
# most two such rows.
_DRAW_ROWS = [(0, 1.0), (0, 0.9), (16, 1.0), (64, 1.0), (65, 1.0), (65, 0.9)]


def _batch(settings: list[tuple[float, int, float]], num_top: int = 0,
           controls: SamplingControls | None = None) -> SamplingBatch:
    """Rows of (temperature, top_k, top_p) reading logits row 0."""
    t, k, p = (np.array(v) for v in zip(*settings))
    z = np.zeros(len(settings), np.int32)
    return SamplingBatch(logits_rows=z, temperature=t.astype(np.float32), top_k=k.astype(np.int32),
                         top_p=p.astype(np.float32), seed=z.astype(np.uint32), stream=z, position=z,
                         num_top=num_top, min_p=np.zeros(len(settings), np.float32), controls=controls)


def _penalties(num_rows: int, history: int) -> SamplingControls:
    """A repetition penalty on every row over a history list of `history` ids."""
    penalties = np.tile(np.array([0.0, 0.0, 1.1], np.float32), (num_rows, 1))
    return SamplingControls(penalties=penalties, history=np.zeros((num_rows, history), np.int32),
                            output_start=np.zeros(num_rows, np.int32))


def sampler_batches(config: EngineConfig, seq_sizes: list[int], vocab: int) -> list[tuple[int, SamplingBatch]]:
    """(S, batch) pairs whose sampling runs every sampler program of the grid: every draw mode of at
    most S rows plain and processed, every top-candidate width, penalties at every history width."""
    batches = []
    pairs = [[(1.0, *a)] for a in _DRAW_ROWS] + [[(1.0, *a), (1.0, *b)] for i, a in enumerate(_DRAW_ROWS)
                                                   for b in _DRAW_ROWS[i + 1:]]
    most_top = min(max(MAX_LOGPROBS, 2 * config.scheduler.max_num_seqs), vocab)
    tops = [width for _, width in padding.padded_sizes(lambda k: top_width(k, vocab), 1, most_top)]
    histories = [width for _, width in padding.padded_sizes(padding.control_width, 1,
                                                              config.scheduler.max_model_len)]
    for size in seq_sizes:
        batches.append((size, _batch([(0.0, 0, 1.0)])))  # all greedy
        for rows in [[(0.0, 0, 1.0)], *pairs]:
            if len(rows) <= size:
                batches.append((size, _batch(rows)))
                batches.append((size, _batch(rows, controls=_penalties(len(rows), histories[0]))))
        batches += [(size, _batch([(0.0, 0, 1.0)], num_top=top)) for top in tops]
        batches += [(size, _batch([(0.0, 0, 1.0)], controls=_penalties(1, width))) for width in histories[1:]]
    return batches


def sampler_programs(config: EngineConfig, seq_sizes: list[int], vocab: int) -> list[SamplerProgram]:
    """Every sampler program of the grid for steps of `seq_sizes` padded sequences, in compile order."""
    programs: dict[SamplerProgram, None] = {}
    for size, batch in sampler_batches(config, seq_sizes, vocab):
        programs.update(dict.fromkeys(sampling.programs_of(batch, size, vocab)))
    return list(programs)


def block_ops(config: EngineConfig) -> list[BlockOp]:
    """Every padded block-operation size under `config`."""
    ops = [BlockOp("copy_blocks", size) for _, size in padding.padded_sizes(padding.pair_bucket, 1,
                                                                             config.scheduler.max_num_seqs)]
    cache = config.cache
    if config.scheduler.preemption_mode == "swap" and cache.num_host_blocks:
        most = min(cache.num_usable_blocks, cache.num_host_blocks)  # one step moves at most this many
        sizes = [size for _, size in padding.padded_sizes(padding.pair_bucket, 1, most)]
        ops += [BlockOp(op, size) for op in ("swap_out", "swap_in") for size in sizes]
    return ops


def grid(config: EngineConfig, vocab: int) -> list[Program]:
    """Every program the engine can run under `config`, in compile order: model steps, the sampler
    (which samples the logits of a step of its S), block operations."""
    steps = model_steps(config)
    seq_sizes = sorted({step.num_seqs for step in steps})
    return [*steps, *sampler_programs(config, seq_sizes, vocab), *block_ops(config)]


def padding_plan(step: ModelStep) -> StepPlan:
    """A plan of `step`'s shape in which every row is padding: tokens write to block 0, no
    sequence has context."""
    tokens, seqs = np.zeros(step.num_tokens, np.int32), np.zeros(step.num_seqs, np.int32)
    return StepPlan(num_seqs=0, num_tokens=0, max_query_len=1 if step.kind == "decode" else 2, token_ids=tokens,
                    positions=tokens, slot_mapping=tokens, query_start_loc=np.zeros(step.num_seqs + 1, np.int32),
                    context_lens=seqs, block_tables=np.zeros((step.num_seqs, step.table_width), np.int32),
                    logits_indices=seqs)


def _block_plan(op: BlockOp) -> StepPlan:
    pairs = [(0, 0)] * op.num_pairs  # block 0 onto itself, or to and from host block 0
    name = {"copy_blocks": "copy", "swap_out": "swap_out", "swap_in": "swap_in"}[op.op]
    return StepPlan.block_ops_only(**{name: pairs})


class WarmUpStopped(Exception):
    """`compile_grid` was told to stop (the server is shutting down) before the grid was compiled."""


def compile_grid(executor: JaxExecutor, config: EngineConfig, *, progress: bool = True,
                 stop: threading.Event | None = None) -> dict:
    """Compiles every program of `grid(config, executor.vocab_size)` by running it once on padding,
    with a progress bar. Returns {"num_programs", "seconds", "cpu_seconds", "num_compilations"}.
    Call it before the engine's first step, never while one runs (it uses the executor's pool).
    `stop` is checked before each program (a compilation itself cannot be interrupted): once set,
    WarmUpStopped is raised, so a shutdown waits for one program at most, not the grid."""
    vocab = executor.vocab_size
    programs = grid(config, vocab)
    steps = [p for p in programs if isinstance(p, ModelStep)]
    ops = [p for p in programs if isinstance(p, BlockOp)]
    start, cpu = time.perf_counter(), time.process_time()
    logits: dict[int, jax.Array] = {}  # the logits of the last step compiled per S
    bar = tqdm(total=len(programs), desc="compile", unit="program", disable=not progress)

    done = 0  # programs compiled (the bar counts nothing when disabled)

    def next_program(program: Program) -> None:
        if stop is not None and stop.is_set():
            bar.close()
            # logged here: the caller may be gone already (a server's shutdown cancels its wait)
            log.info("warm-up stopped after %d of %d programs", done, len(programs))
            raise WarmUpStopped(f"warm-up stopped after {done} of {len(programs)} programs")
        bar.set_postfix_str(_describe(program), refresh=False)

    for step in steps:
        next_program(step)
        logits[step.num_seqs] = executor.run_model(padding_plan(step))
        done += 1
        bar.update()
    seen: set[SamplerProgram] = set()
    for size, batch in sampler_batches(config, sorted(logits), vocab):
        new = [p for p in sampling.programs_of(batch, size, vocab) if p not in seen]
        if new:  # (a batch of programs all run already is skipped)
            next_program(new[0])
            executor.sample(logits[size], batch)
            seen.update(new)
            done += len(new)
            bar.update(len(new))
    for op in ops:
        next_program(op)
        executor.execute(_block_plan(op))
        done += 1
        bar.update()
    jax.block_until_ready(executor.kv_pool)
    bar.close()
    executor.warmed_up = True
    report = {"num_programs": len(programs), "seconds": time.perf_counter() - start,
              "cpu_seconds": time.process_time() - cpu, "num_compilations": executor.num_compilations}
    log.info("compiled %d programs in %.1f s (%.1f s CPU)", report["num_programs"], report["seconds"],
             report["cpu_seconds"])
    return report


def _describe(program: Program) -> str:
    if isinstance(program, ModelStep):
        return f"{program.kind} T={program.num_tokens} S={program.num_seqs} M={program.table_width}"
    if isinstance(program, DrawVariant):
        return f"sample S={program.num_rows} draw={program.mode} controlled={program.controlled}"
    if isinstance(program, TopVariant):
        return f"top S={program.num_rows} width={program.num_top}"
    if isinstance(program, ControlsVariant):
        return f"controls S={program.num_rows} history={program.history}"
    return f"{program.op} {program.num_pairs}"


def enable_compilation_cache() -> Path | None:
    """Points JAX's persistent compilation cache at `$JPAGED_CACHE_DIR/jax` (default
    ~/.cache/jpaged/jax; JPAGED_CACHE_DIR set but empty: no disk cache) and returns that folder.
    A cache folder JAX already has (JAX_COMPILATION_CACHE_DIR, jax.config) is kept, and None
    returned. Call it before anything compiles: JAX decides at its first compilation whether a
    cache is used."""
    root = os.environ.get("JPAGED_CACHE_DIR", DEFAULT_CACHE_DIR)
    if not root or jax.config.jax_compilation_cache_dir:
        return None
    path = Path(root).expanduser() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
    return path
