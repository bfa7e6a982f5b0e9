"""LLMEngine: requests in, tokens out — a thin loop of schedule -> execute -> update -> outputs.

The scheduler decides the step (jpaged.core.sched.scheduler), the executor applies its block operations,
runs the model and samples (jpaged.executors), and the postprocessor applies the sampled tokens:
forks, beam steps, stop checks, frees (jpaged.core.sched.postprocess). Observers watch every step without
wrapping anything (the trace runner measures through them). No jax import: the real executor is
built lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.config.checks import check_str, check_token_ids, show
from jpaged.core.sched import overlap, request_checks, step_guard
from jpaged.core.kv.kv_manager import usage
from jpaged.core.outputs import RequestOutput
from jpaged.core.sched.postprocess import Postprocessor
from jpaged.core.sched.request_checks import CheckedRequest
from jpaged.core.sched.scheduler import Scheduler, SchedulerOutput
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from jpaged.core.step_plan import ModelOutput, StepPlan
from jpaged.executors.base import Executor, OverlapExecutor, PendingStep

logger = logging.getLogger(__name__)


class EngineObserver:
    """Hooks called around every executed step; subclass and override what you need."""

    def on_step_executed(self, engine: LLMEngine, out: SchedulerOutput, result: ModelOutput, start: float,
                         end: float) -> None:
        """After the executor ran the step, before its tokens are applied (blocks as the step saw them)."""

    def on_step_end(self, engine: LLMEngine, out: SchedulerOutput, outputs: list[RequestOutput], end: float) -> None:
        """After the step's tokens are applied; `outputs` are what step() returns."""

    def on_request_finished(self, engine: LLMEngine, group: SequenceGroup, output: RequestOutput) -> None:
        """When step() reports a request finished (stopped, length, aborted or rejected), before
        on_step_end; `group` holds all its sequences (whatever `output` reports)."""


class LLMEngine:
    """Serves requests over a paged KV cache with iteration-level scheduling."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None, scheduler: Scheduler | None = None,
                 eos_token_ids: Seq[int] = ()):
        """`eos_token_ids`: the model's end-of-sequence ids; every request stops at them unless
        `ignore_eos` (the text front ends pass the tokenizer's; token-level users may leave none)."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config: must be an EngineConfig, got {type(config).__name__}")
        self.eos_token_ids = tuple(eos_token_ids)
        if executor is not None and not isinstance(executor, Executor):
            raise TypeError(f"executor: must implement the Executor protocol (execute(plan), now(), vocab_size, "
                            f"num_compilations), got {type(executor).__name__}")
        # The executor first: a pool sized from memory (cache.num_blocks None) is sized once the
        # weights are loaded, and the scheduler's block manager takes its count.
        self.executor = executor if executor is not None else _default_executor(config)
        self.config = config = sized_config(config, self.executor)
        if config.speculative.method == "draft_model" and not getattr(self.executor, "has_draft_model", False):
            raise ValueError(f"speculative.method: 'draft_model' needs an executor that runs the draft model "
                             f"(jpaged.executors.jax.JaxExecutor built from this config); "
                             f"{type(self.executor).__name__} has none")
        self.scheduler = scheduler or Scheduler(config.scheduler, config.cache, speculative=config.speculative)
        self.overlapped = config.scheduler.async_scheduling
        if self.overlapped:
            _check_overlap(self.scheduler, self.executor)
        self.vocab_size = self.executor.vocab_size  # (None: the executor takes any token id)
        self.postprocessor = Postprocessor(self.scheduler)
        self.observers: list[EngineObserver] = []
        self._groups: dict[str, SequenceGroup] = {}
        self._num_arrivals = 0
        self.num_steps = 0
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens run through the model
        self.num_decode_tokens = 0  # sampled tokens fed back through the model
        self.num_seq_steps = 0  # sum over steps of sequences in the batch
        # Overlapped loop: the launched step whose tokens are not applied yet, and its scheduling.
        self._pending: tuple[SchedulerOutput, PendingStep] | None = None
        self.num_steps_ahead = 0  # steps scheduled and launched before the step before them was applied
        self.num_dropped_rows = 0  # rows of sequences that ended one step before theirs: never applied

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Seq[int] | np.ndarray, sampling_params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queues a request; raises TypeError / ValueError naming the field, the value and the allowed
        range if it can never be served (see `request_checks.check_request`).

        `prompt_token_ids`: a list of ints or a 1-D integer numpy array, every id in the vocabulary.
        Requests with different `cache_salt` (a str) never share prefix-cache blocks.
        """
        self._queue(self.check_request(request_id, prompt_token_ids, sampling_params, arrival_time, cache_salt))

    def check_request(self, request_id, prompt_token_ids, sampling_params, arrival_time=None, cache_salt=None,
                      **fields: str) -> CheckedRequest:
        """`request_checks.check_request` against this engine's limits; changes nothing, so a caller
        can check a batch of requests before queueing any. `fields` (prompt_field, params_field)
        name the arguments as the caller's user knows them."""
        return request_checks.check_request(request_id, prompt_token_ids, sampling_params, arrival_time, cache_salt,
                             scheduler=self.config.scheduler, kv=self.scheduler.block_manager,
                             vocab_size=self.vocab_size, in_use=self._groups, eos_token_ids=self.eos_token_ids,
                             speculative=self.config.speculative, **fields)

    def _queue(self, request: CheckedRequest) -> None:
        """Hands a checked request to the scheduler."""
        seq = Sequence(self.scheduler.new_seq_id(), request.prompt)
        arrival = self.executor.now() if request.arrival_time is None else request.arrival_time
        group = SequenceGroup(request.request_id, [seq], request.params, arrival, self._num_arrivals,
                              cache_salt=request.cache_salt, eos_token_ids=self.eos_token_ids)
        self._num_arrivals += 1
        self._groups[request.request_id] = group
        self.postprocessor.track(group)
        self.scheduler.add(group)

    def abort(self, request_id: str) -> None:
        """Stops a request; its output (finish reason "abort") comes with the next step()."""
        group = self._groups.get(check_str("request_id", request_id))
        if group is None or group.finish_time is not None:
            raise KeyError(f"cannot abort request {request_id!r}: no such unfinished request")
        self.scheduler.abort(group)
        self.postprocessor.finish_group(group, self.executor.now(), SequenceStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, indices: Seq[int] | None = None,
                       status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        """Ends samples of a request from outside the core: the text front end found a stop string.

        The live sequences with sample index in `indices` (None: all) end with `status` and free
        their blocks now; once none is left the request's output comes with the next step().
        Sequences that already finished are left as they are.
        """
        group = self._groups.get(request_id)
        if group is None or group.finish_time is not None:
            raise KeyError(f"cannot finish request {request_id!r}: no such unfinished request")
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        chosen = group.live_seqs() if indices is None else [s for s in group.live_seqs() if s.index in set(indices)]
        for seq in chosen:
            seq.status = status
        if group.is_finished:  # from whichever queue holds it; every block back
            self.scheduler.abort(group)
            self.postprocessor.finish_group(group, self.executor.now())
        else:
            for seq in chosen:
                self.scheduler.free_seq(seq)

    def pin_prefix(self, prompt_token_ids: Seq[int] | np.ndarray, cache_salt: str | None = None) -> int:
        """Pre-stores a prefix (paper §4.4, "as how OS handles shared library"): computes its KV
        blocks once and pins them in the prefix cache, never evicted. Requests whose prompts start
        with it (under the same `cache_salt`) map its blocks, the last one copy-on-write when the
        prefix ends inside a block, so no request computes any of it. Returns the prefix's blocks
        (pins of prefixes that start alike share theirs: `kv_stats` counts distinct blocks).

        The engine must be idle (nothing unfinished). A prefix pinned already, or of whole blocks
        the cache holds on the device, is pinned as it is. Otherwise it runs as a request of its
        own (checked as a prompt is, errors naming `prefix`), which is then ended and drained,
        also when pinning fails.
        """
        bm = self.scheduler.block_manager
        if bm.prefix_cache is None:
            raise ValueError("cache.enable_prefix_caching: pinning a prefix needs the prefix cache (set it true)")
        if self.has_unfinished():
            raise RuntimeError("pin_prefix: the engine must be idle (requests are unfinished)")
        prefix = check_token_ids("prefix", prompt_token_ids, self.vocab_size)
        cache_salt = check_str("cache_salt", cache_salt, optional=True)
        blocks = bm.pin_cached(prefix, cache_salt)
        if blocks is None:
            blocks = self._compute_and_pin(prefix, cache_salt)
        return len(blocks)

    def _compute_and_pin(self, prefix: list[int], cache_salt: str | None) -> list[int]:
        """Runs `prefix` as a request until its prefill is computed and pins its blocks; the
        request is ended and drained whatever happens. Returns the pinned blocks."""
        request_id = f"pin-{self._num_arrivals}"  # (an idle engine holds no request ids)
        request = self.check_request(request_id, prefix, SamplingParams(max_tokens=2, ignore_eos=True), None,
                                     cache_salt, prompt_field="prefix", subject="prefix")
        self._queue(request)
        group = self._groups[request_id]
        seq = group.seqs[0]
        try:
            while seq.num_output_tokens == 0 and group.finish_time is None:  # until its prefill is computed
                self.step()
            if group.finish_time is not None:  # refused or ended with an error: it never ran
                raise ValueError(f"prefix: could not be computed ({group.error or 'it ended before its prefill'})")
            return self.scheduler.block_manager.pin_prefix(seq.seq_id, request.prompt, request.cache_salt)
        finally:
            if group.finish_time is None:
                self.abort(request_id)
            while self.has_unfinished():  # reports (and forgets) the ended request
                self.step()

    def has_unfinished(self) -> bool:
        """True while any request waits, runs, is swapped out, or has an unreported output."""
        return self.scheduler.has_unfinished() or bool(self.postprocessor.outputs) or self._pending is not None

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the requests that finished in it (and streaming ones that moved).

        Overlapped (`scheduler.async_scheduling`), an iteration applies the step launched by the
        last one, so outputs come one call later; in the decode steady state it first schedules
        and launches the next step (`jpaged.core.sched.overlap`)."""
        if self.overlapped:
            return self._step_overlapped()
        out = self._schedule()
        plan = out.plan
        if plan.num_seqs or plan.has_block_ops:
            started = self.executor.now()
            result = self._execute(plan)
            self._apply(out, result, started, self.executor.now())
        return self._report(out)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's next step; requests it cannot ever run end with an error."""
        out = self.scheduler.schedule()
        for group, reason in out.rejected:
            logger.warning("ending request %s: %s", group.request_id, reason)
            self.postprocessor.finish_group(group, self.executor.now(), SequenceStatus.FINISHED_ABORTED, error=reason)
        return out

    def _apply(self, out: SchedulerOutput, result: ModelOutput, started: float, now: float) -> None:
        """Counts an executed step, shows it to the observers and applies its tokens."""
        plan = out.plan
        self.num_steps += 1
        self.num_seq_steps += plan.num_seqs
        self.num_prefill_tokens += plan.num_prefill_tokens
        self.num_decode_tokens += plan.num_tokens - plan.num_prefill_tokens
        for observer in self.observers:
            observer.on_step_executed(self, out, result, started, now)
        self.postprocessor.update(out, result, started, now)

    def _step_overlapped(self) -> list[RequestOutput]:
        """One iteration of the overlapped loop: collect the pending step (scheduling and launching
        the next one first in the decode steady state, while the device still runs it) and apply
        it; with nothing pending then, schedule and launch a step and leave it pending."""
        out = None  # the step applied in this iteration (observers see its end)
        if self._pending is not None:
            out, launched = self._pending
            self._pending = None
            self.num_dropped_rows += overlap.drop_finished_rows(out.plan)  # (ended since it was scheduled)
            ahead = self.scheduler.schedule_decode() if overlap.can_follow(out) else None
            result = self._collect(launched)
            if ahead is not None:
                # Step n+1's input ids are step n's tokens: its rows are step n's, in the same order.
                overlap.feed(ahead.plan, out.plan.sampling, result.token_ids)
                self._pending = (ahead, self.executor.launch(ahead.plan))
                self.num_steps_ahead += 1
            self._apply(out, result, launched.started, self.executor.now())
            if ahead is not None:
                ahead.batch.forget_sampled()  # (recorded by `_apply` for step n, after step n+1 was scheduled)
        if self._pending is None:
            scheduled = self._schedule()
            if scheduled.plan.num_seqs or scheduled.plan.has_block_ops:
                self._pending = (scheduled, self.executor.launch(scheduled.plan))
            out = out or scheduled
        return self._report(out)

    def _collect(self, launched: PendingStep) -> ModelOutput:
        """The launched step's tokens, guarded as `_execute`'s step is."""
        return self._guarded(launched.plan, lambda: self.executor.collect(launched))

    def _report(self, out: SchedulerOutput) -> list[RequestOutput]:
        """The outputs collected since the last report; finished requests are forgotten."""
        outputs = self.postprocessor.drain()
        for output in outputs:
            if output.finished:
                group = self._groups.pop(output.request_id)
                for observer in self.observers:
                    observer.on_request_finished(self, group, output)
        for observer in self.observers:
            observer.on_step_end(self, out, outputs, self.executor.now())
        return outputs

    def _execute(self, plan: StepPlan) -> ModelOutput:
        """Runs the plan, guarded (`_guarded`)."""
        return self._guarded(plan, lambda: self.executor.execute(plan))

    def _guarded(self, plan: StepPlan, run: Callable[[], ModelOutput]) -> ModelOutput:
        """`run()` (the executor's execute or collect of `plan`). When it fails, the requests whose
        own sample rows cannot be prepared (`step_guard.failing_groups`) end alone with an error and
        it runs again without their rows: executors raise before changing any state when a
        request's data is at fault (see `Executor.execute`). A failure no request explains propagates."""
        while True:
            try:
                result = run()
                break
            except Exception:
                if not self._fail_own_rows(plan):
                    raise
        self._check_rows(plan, result)
        return result

    def _fail_own_rows(self, plan: StepPlan) -> bool:
        """After a failed step: ends the requests whose own sample rows cannot be prepared
        (`step_guard.failing_groups`) and takes their rows out of `plan`; False when none does."""
        failures = step_guard.failing_groups(plan.sampling) if plan.sampling is not None else {}
        now = self.executor.now()
        for group, error in failures.items():
            self.postprocessor.fail_group(group, now, error)
        if failures:
            plan.sampling = step_guard.without_groups(plan.sampling, failures)
        return bool(failures)

    def _check_rows(self, plan: StepPlan, result: ModelOutput) -> None:
        num_rows = 0 if plan.sampling is None else len(plan.sampling.seqs)
        if len(result.token_ids) != num_rows:
            raise RuntimeError(f"{type(self.executor).__name__} returned {len(result.token_ids)} tokens "
                               f"for {num_rows} sample rows")

    # ------------------------------------------------------------------ conveniences

    def generate(self, prompts: list[Seq[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serves `prompts` to completion; outputs come back in prompt order.

        Every request is checked before any is queued: a bad one raises (naming `prompts[i]` or
        `sampling_params[i]`) and leaves the engine as it was.
        """
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts: must be a list of prompts (each a list of token ids), "
                            f"got {type(prompts).__name__} {show(prompts)}")
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts "
                                 f"(pass one SamplingParams, or one per prompt)")
            params, fields = list(sampling_params), [f"sampling_params[{i}]" for i in range(len(prompts))]
        else:
            params, fields = [sampling_params] * len(prompts), ["sampling_params"] * len(prompts)
        ids = self._fresh_request_ids(len(prompts))
        requests = [self.check_request(request_id, prompt, p, None, None, prompt_field=f"prompts[{i}]",
                                        params_field=field)
                    for i, (request_id, prompt, p, field) in enumerate(zip(ids, prompts, params, fields))]
        for request in requests:
            self._queue(request)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        start = time.perf_counter()
        wanted = set(ids)
        while self.has_unfinished() and len(results) < len(prompts):
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    results[output.request_id] = output
                    bar.update(1)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(prefill_tok_s=f"{self.num_prefill_tokens / elapsed:.0f}",
                            decode_tok_s=f"{self.num_decode_tokens / elapsed:.0f}",
                            kv=f"{usage(self.scheduler.block_manager):.0%}", refresh=False)
        bar.close()
        return [results[i] for i in ids]

    def _fresh_request_ids(self, count: int) -> list[str]:
        """`count` request ids "gen-<k>" that no unfinished request uses."""
        ids, k = [], self._num_arrivals
        while len(ids) < count:
            if f"gen-{k}" not in self._groups:
                ids.append(f"gen-{k}")
            k += 1
        return ids

    def kv_stats(self) -> dict:
        """Block pool and preemption counters, and the pool's size."""
        bm = self.scheduler.block_manager
        swap = bm.swap  # (None: a manager without swap space)
        size = getattr(self.executor, "kv_cache", None)  # jpaged.models.kv_pool.KVCacheSize of a device pool
        block_size = self.config.cache.block_size
        return {
            "num_total_blocks": bm.num_usable_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_host_blocks": swap.num_blocks if swap is not None else 0,
            "num_free_host_blocks": swap.num_free_blocks if swap is not None else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_usage": usage(bm),
            # The pool's size (vLLM's start-up figures): blocks with block 0, their bytes on one device
            # (None: an executor without a device pool, e.g. the simulator), and how many requests of
            # max_model_len tokens it holds at once.
            "num_blocks": bm.num_usable_blocks + 1,
            "block_size": block_size,
            "kv_cache_bytes": size.bytes if size is not None else None,
            "max_concurrency": bm.num_usable_blocks / -(-self.config.scheduler.max_model_len // block_size),
            "num_compilations": self.executor.num_compilations,
            **self.prefix_cache_stats(),
            **self.spec_decode_stats(),
        }

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters (`speculation.SpecStats.as_dict`): drafts, drafted and
        accepted tokens, accepted drafts per position and the mean acceptance length; {} when off."""
        speculator = self.scheduler.speculator
        return {} if speculator is None else speculator.stats.as_dict()

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache hit rate (cached tokens / prompt tokens admitted, both tiers), cached device
        blocks, device evictions, pinned blocks, and the host tier's size, use and traffic
        (`Scheduler.prefix_cache_stats`)."""
        return self.scheduler.prefix_cache_stats()


def _check_overlap(scheduler: Scheduler, executor: Executor) -> None:
    """Refuses `scheduler.async_scheduling` where the overlapped loop cannot run."""
    if not isinstance(executor, OverlapExecutor):
        raise TypeError(f"scheduler.async_scheduling: {type(executor).__name__} cannot overlap steps (it has no "
                         f"launch / collect); set async_scheduling to false")
    if scheduler.batching is not None:
        # The rule gates admission around every step, which a step scheduled ahead would skip.
        raise ValueError(f"scheduler.async_scheduling: not supported with {type(scheduler.batching).__name__} "
                         f"(it gates admission step by step); set async_scheduling to false")


def sized_config(config: EngineConfig, executor: Executor) -> EngineConfig:
    """`config` with the block count of the device pool `executor` sized from memory where
    cache.num_blocks is None (its `kv_cache`, jpaged.executors.kv_sizing); otherwise `config`."""
    size = getattr(executor, "kv_cache", None)
    if config.cache.num_blocks is not None or size is None:
        return config
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=size.num_blocks))


def _default_executor(config: EngineConfig) -> Executor:
    if config.executor == "jax":
        from jpaged.executors.jax import JaxExecutor

        return JaxExecutor(config)
    raise ValueError(f"executor {config.executor!r} needs explicit construction (pass executor=...)")
