"""Every program a config can need, compiled before the first request, and the disk cache behind them.

`grid(config)` lists the programs the engine can produce under `config`, derived from the
padding rules the scheduler and executor use (jpaged.core.padding) and the config's limits:

- model steps: one per padded token count T, at the ragged shape of T (S the power of two at or
  above T, at most max_num_seqs; M the full table width: `padding.ragged_shapes`), from a single
  decode to the token budget; each also computes prompt log-probabilities, behind a `lax.cond`
  (jpaged.models.runner);
- the sampler (jpaged.executors.sampling): ONE program per step's S (`SamplerProgram`), which
  serves every draw mode, control, combination of controls and top-candidate width, the work a
  step does not need skipped at run time;
- block operations: copy-on-write pair arrays (at most one copy per running sequence a step) and,
  under swap preemption with a host pool, swap-out and swap-in pair arrays;
- with a draft model (speculative.method draft_model, jpaged.executors.drafting): its step at
  every model-step shape (it mirrors the target's), one draft loop per verify step's padded
  sequence count, and its pool's block operations.

A new static variant of any stage is one more family in `grid`. `compile_grid` runs each program
once on padding (padded tokens write only to the reserved block 0; swaps move block 0), so the
executor's `num_compilations` afterwards equals the grid's size and serving compiles nothing more;
the compilations run on a thread per core. `enable_compilation_cache` keeps compiled programs on
disk twice over: JAX's cache (`$JPAGED_CACHE_DIR/jax`, default ~/.cache/jpaged/jax), keyed by the
lowered program, which serves any program whose code is unchanged after a trace, and the
executable store (`$JPAGED_CACHE_DIR/executables`, jpaged.models.executable_store), keyed by the
program's identity, shapes and the code's fingerprint, from which a restart, or a start on a copy
of the folder at another path, loads the model steps and the sampler without tracing them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.core import padding
from jpaged.core.step_plan import ModelOutput, SamplingBatch, StepPlan
from jpaged.executors import drafting
from jpaged.executors.sampling import SampleResult, SamplerProgram
from jpaged.models import executable_store


log = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/jpaged"
# Programs that compile faster than this are not written to the disk cache: reading an entry back
# costs a few milliseconds, and the smallest eager operations compile in about that.
MIN_CACHED_COMPILE_S = 0.05


@dataclasses.dataclass(frozen=True)
class ModelStep:
    """One padded shape of the jitted model step: the ragged shape of its T."""

    num_tokens: int  # T
    num_seqs: int  # S: the power of two at or above T, at most max_num_seqs
    table_width: int  # M: the full width
    draft: bool = False  # the draft model's step (speculative.method draft_model), else the target's


@dataclasses.dataclass(frozen=True)
class DraftLoop:
    """The draft model's loop of a verify step of S padded sequences (jpaged.executors.drafting)."""

    num_seqs: int  # S


@dataclasses.dataclass(frozen=True)
class BlockOp:
    """One padded size of a block operation's pair array."""

    op: str  # "copy_blocks", "swap_out", "swap_in"; "draft_" + those: the draft model's pool
    num_pairs: int


Program = ModelStep | SamplerProgram | BlockOp | DraftLoop


def model_steps(config: EngineConfig) -> list[ModelStep]:
    """Every model-step shape the scheduler's plans run at under `config`: one per token bucket."""
    sched = config.scheduler
    max_blocks = -(-sched.max_model_len // config.cache.block_size)  # the block table's full width
    return [ModelStep(*shape) for shape in padding.ragged_shapes(sched.max_num_seqs, sched.max_num_batched_tokens,
                                                                 max_blocks)]


def sampler_programs(seq_sizes: list[int]) -> list[SamplerProgram]:
    """The sampler's programs for steps of `seq_sizes` padded sequences: one per row count, which
    serves every mode and control (jpaged.executors.sampling)."""
    return [SamplerProgram(size) for size in seq_sizes]


def _greedy_rows(num_rows: int) -> SamplingBatch:
    """`num_rows` greedy rows reading logits row 0: any batch runs the row count's one program."""
    z = np.zeros(num_rows, np.int32)
    return SamplingBatch(logits_rows=z, temperature=z.astype(np.float32), top_k=z, top_p=np.ones(num_rows, np.float32),
                         seed=z.astype(np.uint32), stream=z, position=z)


def block_ops(config: EngineConfig) -> list[BlockOp]:
    """Every padded block-operation size under `config`."""
    copies = ["copy_blocks", "draft_copy_blocks"] if _drafts(config) else ["copy_blocks"]
    ops = [BlockOp(op, size) for op in copies
           for _, size in padding.padded_sizes(padding.pair_bucket, 1, config.scheduler.max_num_seqs)]
    cache = config.cache
    if config.scheduler.preemption_mode == "swap" and cache.num_host_blocks:
        most = min(cache.num_usable_blocks, cache.num_host_blocks)  # one step moves at most this many
        sizes = [size for _, size in padding.padded_sizes(padding.pair_bucket, 1, most)]
        swaps = ("swap_out", "swap_in")
        if _drafts(config):
            swaps += ("draft_swap_out", "draft_swap_in")
        ops += [BlockOp(op, size) for op in swaps for size in sizes]
    return ops


def _drafts(config: EngineConfig) -> bool:
    """True when `config` runs a draft model (speculative.method draft_model)."""
    return config.speculative.method == "draft_model"


def draft_programs(config: EngineConfig) -> list[ModelStep | DraftLoop]:
    """The draft model's programs under `config` (none without one): its step at every shape of
    the target's, which it mirrors, and one draft loop per verify step's padded sequence count."""
    if not _drafts(config):
        return []
    steps = [dataclasses.replace(step, draft=True) for step in model_steps(config)]
    return [*steps, *(DraftLoop(size) for size in drafting.draft_loop_sizes(config))]


def grid(config: EngineConfig) -> list[Program]:
    """Every program the engine can run under `config`, in compile order: model steps, the draft
    model's steps and loops, the sampler (which samples the logits of a step of its S), block
    operations."""
    steps = model_steps(config)
    seq_sizes = sorted({step.num_seqs for step in steps})
    return [*steps, *draft_programs(config), *sampler_programs(seq_sizes), *block_ops(config)]


def padding_plan(step: ModelStep) -> StepPlan:
    """A plan of `step`'s shape in which every row is padding: tokens write to block 0, no
    sequence has context."""
    tokens, seqs = np.zeros(step.num_tokens, np.int32), np.zeros(step.num_seqs, np.int32)
    return StepPlan(num_seqs=0, num_tokens=0, max_query_len=1, token_ids=tokens, positions=tokens, slot_mapping=tokens,
                    query_start_loc=np.zeros(step.num_seqs + 1, np.int32), context_lens=seqs,
                    block_tables=np.zeros((step.num_seqs, step.table_width), np.int32), logits_indices=seqs)


def _block_plan(op: BlockOp) -> StepPlan:
    pairs = [(0, 0)] * op.num_pairs  # block 0 onto itself, or to and from host block 0
    # (a block operation runs on the draft model's pool too: "draft_" + its name is that program)
    name = {"copy_blocks": "copy", "swap_out": "swap_out", "swap_in": "swap_in"}[op.op.removeprefix("draft_")]
    return StepPlan.block_ops_only(**{name: pairs})


class CompilingExecutor(Protocol):
    """What `compile_grid` runs the grid on (the JAX executor, `jpaged.executors.jax.JaxExecutor`)."""

    kv_pool: object  # the device pool, waited on once the grid ran
    warmed_up: bool  # set once the grid ran: a program compiled later is logged

    @property
    def num_compilations(self) -> int:
        """Distinct programs run so far."""

    def run_model(self, plan: StepPlan, draft: bool = False) -> jax.Array:
        """The model step of `plan` alone (`draft`: the draft model's): its logits [S, V]."""

    def prepare_model(self, plan: StepPlan, draft: bool = False) -> Callable[[], None]:
        """Readies the model step of `plan` (`draft`: the draft model's): found in the executable
        store, or traced and lowered, now; the returned call (on any thread) loads or compiles it."""

    def prepare_draft_loop(self, num_seqs: int) -> Callable[[], None]:
        """`prepare_model` for the draft loop of `num_seqs` padded sequences."""

    def sample(self, logits: jax.Array, batch: SamplingBatch) -> SampleResult:
        """The sampler on `logits`."""

    def execute(self, plan: StepPlan) -> ModelOutput:
        """A whole step (block operations only, here)."""


class WarmUpStopped(Exception):
    """`compile_grid` was told to stop (the server is shutting down) before the grid was compiled."""


def compile_grid(executor: CompilingExecutor, config: EngineConfig, *, progress: bool = True,
                 stop: threading.Event | None = None, workers: int | None = None) -> dict:
    """Compiles every program of `grid(config)` and runs it once on padding, with a progress bar.
    Returns {"num_programs", "seconds", "cpu_seconds", "num_compilations", "workers"}. Call it
    before the engine's first step, never while one runs (it uses the executor's pool).

    Compilations run on `workers` threads (default: one per CPU core): XLA releases the GIL while
    it compiles or loads a program from the disk cache, and tracing (Python) goes on meanwhile.
    Model steps are readied here, one at a time (found in the executable store, or traced and
    lowered), each loaded or compiled on the pool while the next is readied; then each step runs
    once (nothing compiles now) and its logits feed the sampler of its S, whose programs load or
    trace and compile on the pool; block
    operations, which replace the pool, run here last. `stop` is checked between programs (a
    compilation itself cannot be interrupted): once set, the queued compilations are dropped, the
    running ones (at most `workers`) finished, and WarmUpStopped raised."""
    programs = grid(config)
    steps = [p for p in programs if isinstance(p, ModelStep)]
    loops = [p for p in programs if isinstance(p, DraftLoop)]
    samplers = [p for p in programs if isinstance(p, SamplerProgram)]
    ops = [p for p in programs if isinstance(p, BlockOp)]
    workers = workers or os.cpu_count() or 1
    start, cpu = time.perf_counter(), time.process_time()
    bar = tqdm(total=len(programs), desc="compile", unit="program", disable=not progress)
    lock = threading.Lock()
    done = 0  # programs compiled (the bar counts nothing when disabled)

    def compiled(program: Program) -> None:  # on the thread that compiled it
        nonlocal done
        with lock:
            done += 1
            bar.set_postfix_str(_describe(program), refresh=False)
            bar.update()

    def submit(program: Program, compile_fn, *args) -> Future:
        future = pool.submit(compile_fn, *args)
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or compiled(program))
        return future

    def check_stop() -> None:
        if stop is not None and stop.is_set():
            pool.shutdown(wait=True, cancel_futures=True)  # the running compilations cannot be cut short
            bar.close()
            # logged here: the caller may be gone already (a server's shutdown cancels its wait)
            log.info("warm-up stopped after %d of %d programs", done, len(programs))
            raise WarmUpStopped(f"warm-up stopped after {done} of {len(programs)} programs")

    with ThreadPoolExecutor(workers, thread_name_prefix="jpaged-compile") as pool:
        try:
            # Model steps are readied here and loaded or compiled on the pool while the next one readies.
            compiling = []
            for step in steps:
                check_stop()
                compiling.append(submit(step, executor.prepare_model(padding_plan(step), step.draft)))
            looping = []  # draft loops, ready for the first verify step
            for loop in loops:
                check_stop()
                looping.append(submit(loop, executor.prepare_draft_loop(loop.num_seqs)))
            sampled: dict[int, Future] = {}  # S -> its sampler program, run on the logits of a step of S
            for future in looping:
                check_stop()
                future.result()
            for step, future in zip(steps, compiling):
                check_stop()
                future.result()
                out = executor.run_model(padding_plan(step), step.draft)  # f32[S, V]
                if step.draft:
                    continue
                if step.num_seqs not in sampled:
                    sampled[step.num_seqs] = submit(SamplerProgram(step.num_seqs), executor.sample, out,
                                                    _greedy_rows(1))
            for program in samplers:
                check_stop()
                sampled[program.num_rows].result()
            for op in ops:
                check_stop()
                executor.execute(_block_plan(op))
                compiled(op)
        except BaseException:  # a failed compilation or a stop: no queued one starts
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    jax.block_until_ready(executor.kv_pool)
    bar.close()
    executor.warmed_up = True
    report = {"num_programs": len(programs), "seconds": time.perf_counter() - start,
              "cpu_seconds": time.process_time() - cpu, "num_compilations": executor.num_compilations,
              "workers": workers}
    log.info("compiled %d programs in %.1f s (%.1f s CPU, %d threads)", report["num_programs"], report["seconds"],
             report["cpu_seconds"], workers)
    return report


def _describe(program: Program) -> str:
    if isinstance(program, ModelStep):
        return f"{'draft ' if program.draft else ''}step T={program.num_tokens} S={program.num_seqs} " \
               f"M={program.table_width}"
    if isinstance(program, DraftLoop):
        return f"draft loop S={program.num_seqs}"
    if isinstance(program, SamplerProgram):
        return f"sample S={program.num_rows}"
    return f"{program.op} {program.num_pairs}"


def enable_compilation_cache() -> Path | None:
    """Points JAX's persistent compilation cache at `$JPAGED_CACHE_DIR/jax` (default
    ~/.cache/jpaged/jax; JPAGED_CACHE_DIR set but empty: no disk cache) and opens the executable
    store at `$JPAGED_CACHE_DIR/executables`; returns JAX's folder. A cache folder JAX already
    has (JAX_COMPILATION_CACHE_DIR, jax.config) is kept, and None returned (the store still
    opens). Call it before anything compiles: JAX decides at its first compilation whether a
    cache is used. No key holds the folder's path: a moved or copied folder still hits."""
    root = os.environ.get("JPAGED_CACHE_DIR", DEFAULT_CACHE_DIR)
    if not root:
        return None
    executable_store.enable(Path(root).expanduser() / "executables")
    if jax.config.jax_compilation_cache_dir:
        return None
    path = Path(root).expanduser() / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_CACHED_COMPILE_S)
    if "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES" not in os.environ:  # an explicit choice stays
        # JAX's default also turns on XLA's per-fusion autotune cache at `<cache>/xla_gpu_per_fusion_
        # autotune_cache_dir` and passes that absolute path in the compile options, which are part of
        # every entry's key (also on CPU, where nothing reads it): a moved or copied cache folder then
        # missed for every program. The entries hold whole executables, autotuned ones on GPU; the
        # sub-cache only helps a program that is not in the cache yet.
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return path
