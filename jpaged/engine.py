"""LLMEngine: requests in, tokens out — scheduler + block manager + an Executor, one step at a time.

A step: the scheduler emits a StepPlan; the executor applies its block operations and runs the
model; the engine samples, appends tokens, forks sequences for parallel sampling and beam search,
frees finished or dropped sequences, and reports finished requests.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from jpaged import beam_search
from jpaged.config import EngineConfig
from jpaged.executors.base import Executor
from jpaged.sampling import SamplingBatch, request_stream, sample
from jpaged.scheduler import Scheduler
from jpaged.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus

logger = logging.getLogger(__name__)

# Token appended when the executor has no model (simulator): lengths come from max_tokens.
SIMULATED_TOKEN = 0


@dataclasses.dataclass
class RequestOutput:
    """A finished (or aborted) request."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[list[int]]  # per returned sequence (n samples, or beams best first)
    cumulative_logprobs: list[float]  # per returned sequence
    finish_reasons: list[str]  # per returned sequence: "stop", "length" or "abort"
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None  # why the engine rejected the request, if it did

    @property
    def finished(self) -> bool:
        """Always True: step() reports requests once they finish."""
        return True


class LLMEngine:
    """Serves requests over a paged KV cache with iteration-level scheduling."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None, scheduler: Scheduler | None = None):
        self.config = config
        self.scheduler = scheduler or Scheduler(config.scheduler, config.cache)
        self.executor = executor if executor is not None else _default_executor(config)
        self.vocab_size: int | None = getattr(self.executor, "vocab_size", None)
        self._groups: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_seq_steps = 0  # sum over steps of sequences in the batch
        self._num_multi_seq_groups = 0  # unfinished requests with n > 1 or beam search

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:
        """Queues a request; raises ValueError naming the problem if it can never be served.

        Requests with different `cache_salt` never share prefix-cache blocks.
        """
        cfg = self.config
        prompt = list(prompt_token_ids)
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        if len(prompt) >= cfg.scheduler.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens leaves no room to generate "
                             f"within max_model_len={cfg.scheduler.max_model_len}")
        if len(prompt) > cfg.scheduler.max_num_batched_tokens:
            raise ValueError(f"request {request_id!r}: prompt of {len(prompt)} tokens exceeds "
                             f"max_num_batched_tokens={cfg.scheduler.max_num_batched_tokens}")
        if self.vocab_size is not None and (min(prompt) < 0 or max(prompt) >= self.vocab_size):
            raise ValueError(f"request {request_id!r}: token ids must be in [0, {self.vocab_size}), "
                             f"got range [{min(prompt)}, {max(prompt)}]")
        bm = self.scheduler.block_manager
        if bm.blocks_for(len(prompt) + 1) > bm.num_usable_blocks - bm.watermark_blocks:
            raise ValueError(f"request {request_id!r}: {len(prompt)} prompt tokens need "
                             f"{bm.blocks_for(len(prompt) + 1)} KV blocks; the pool has {bm.num_usable_blocks} "
                             f"(cache.num_blocks - 1) minus a watermark of {bm.watermark_blocks}")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        max_tokens = min(sampling_params.max_tokens, cfg.scheduler.max_model_len - len(prompt))
        params = dataclasses.replace(sampling_params, max_tokens=max_tokens)
        seq = Sequence(next(self._seq_ids), prompt)
        group = SequenceGroup(request_id, [seq], params,
                              self.executor.now() if arrival_time is None else arrival_time,
                              next(self._arrivals), cache_salt=cache_salt)
        self._groups[request_id] = group
        self._num_multi_seq_groups += not group.is_single
        self.scheduler.add(group)

    def abort(self, request_id: str) -> None:
        """Stops a request; its output (finish reason "abort") comes with the next step()."""
        group = self._groups.get(request_id)
        if group is None:
            raise KeyError(f"cannot abort request {request_id!r}: no such unfinished request")
        self.scheduler.abort(group)
        self._finish_group(group, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        """True while any request waits, runs, is swapped out, or has an unreported output."""
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Runs one iteration; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        for group, reason in out.rejected:
            logger.warning("rejecting request %s: %s", group.request_id, reason)
            self._finish_group(group, SequenceStatus.FINISHED_ABORTED, error=reason)
        plan = out.plan
        if plan.is_empty and not (len(plan.swap_in_pairs) or len(plan.swap_out_pairs) or len(plan.copy_pairs)):
            return self._drain_outputs()
        started = self.executor.now()
        result = self.executor.execute(plan)
        self.num_steps += 1
        now = self.executor.now()
        self.num_seq_steps += plan.num_seqs
        if plan.num_seqs:
            if plan.is_prefill:
                self.num_prefill_tokens += plan.num_tokens
                for group in out.groups:  # a prefill step schedules a group first and samples its first token
                    if group.first_scheduled_time is None:
                        group.first_scheduled_time = started
                        group.first_token_time = now
            else:
                self.num_decode_tokens += plan.num_seqs
            self._process(out.seqs, result.logits, now)
        self.scheduler.remove_finished()
        return self._drain_outputs()

    def _process(self, seqs: list[Sequence], logits, now: float) -> None:
        """Samples the step's rows, forks parallel samples after a prompt, advances beams."""
        groups = [s.group for s in seqs]
        if self._num_multi_seq_groups == 0:  # the common case: one sequence per request
            if logits is None:
                self._append_all(seqs, groups, [SIMULATED_TOKEN] * len(seqs), None, now)
            else:
                result = sample(logits, self._sampling_batch([(s, i, 0) for i, s in enumerate(seqs)], groups))
                self._append_all(seqs, groups, result.token_ids.tolist(), result.logprobs.tolist(), now)
            return
        # One sampling row per (sequence, logits row, index of the sequence in its group).
        rows: list[tuple[Sequence, int, int]] = []
        beam_groups: dict[str, list[int]] = {}  # request id -> indices into `rows` of its beams
        for logits_row, (seq, group) in enumerate(zip(seqs, groups)):
            params = group.sampling_params
            if params.use_beam_search:
                beam_groups.setdefault(group.request_id, []).append(len(rows))
                rows.append((seq, logits_row, 0))
            elif seq.num_output_tokens == 0 and params.n > 1 and len(group.seqs) == 1:
                # A fresh prompt: its n samples share the prompt's blocks and draw from its logits.
                for i in range(params.n):
                    rows.append((seq if i == 0 else self._fork(group, seq), logits_row, i))
            else:
                rows.append((seq, logits_row, group.seqs.index(seq) if params.n > 1 else 0))
        row_groups = [seq.group for seq, _, _ in rows]
        plain = [k for k, (seq, _, _) in enumerate(rows) if not row_groups[k].sampling_params.use_beam_search]
        if logits is None:
            tokens, logprobs = [SIMULATED_TOKEN] * len(rows), None
            for indices in beam_groups.values():
                beams = [rows[i][0] for i in indices]
                self._beam_step(beams, *self._synthetic_candidates(beams), now)
        else:
            result = sample(logits, self._sampling_batch(rows, row_groups))
            tokens, logprobs = result.token_ids.tolist(), result.logprobs.tolist()
            for indices in beam_groups.values():
                self._beam_step([rows[i][0] for i in indices], result.top_ids[indices],
                                result.top_logprobs[indices], now)
        self._append_all([rows[k][0] for k in plain], [row_groups[k] for k in plain], [tokens[k] for k in plain],
                         None if logprobs is None else [logprobs[k] for k in plain], now)

    def _append_all(self, seqs: list[Sequence], groups: list[SequenceGroup], tokens: list[int],
                    logprobs: list[float] | None, now: float) -> None:
        """Appends one sampled token per sequence and applies the stop checks.

        Runs for every sequence of every step, so the common path is an append and two compares.
        """
        if logprobs is not None:
            for seq, logprob in zip(seqs, logprobs):
                seq.cumulative_logprob += logprob
        for seq, group, token in zip(seqs, groups, tokens):
            ids = seq.token_ids
            ids.append(token)
            if len(ids) < group.max_total_len and token not in group.stop_set:
                continue
            stopped = token in group.stop_set
            self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH)
            if group.is_finished:
                self._finish_group(group, None, now=now)

    def _sampling_batch(self, rows: list[tuple[Sequence, int, int]], groups: list[SequenceGroup]) -> SamplingBatch:
        """Sampling settings of each row (sequence, logits row, index of the sequence in its group)."""
        params = [g.sampling_params for g in groups]
        widths = [p.n for p in params if p.use_beam_search]
        return SamplingBatch(
            logits_rows=np.array([r for _, r, _ in rows], np.int32),
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            seed=np.array([p.seed for p in params], np.uint32),
            stream=np.array([request_stream(g.request_id, i) for g, (_, _, i) in zip(groups, rows)], np.int32),
            position=np.array([len(seq) for seq, _, _ in rows], np.int32),
            num_top=2 * max(widths, default=0))

    def _synthetic_candidates(self, beams: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """Beam candidates without a model (simulator): seeded random log-probabilities.

        Beams still branch, share and die as in a real search, so memory sharing can be measured;
        the draws depend only on (seed, request, position, beam), like real sampling.
        """
        group = beams[0].group
        num_top = 2 * group.sampling_params.n
        stream = request_stream(group.request_id, 0)
        top_logprobs = np.empty((len(beams), num_top))
        for i, seq in enumerate(beams):
            rng = np.random.default_rng((group.sampling_params.seed, stream, len(seq), i))
            top_logprobs[i] = -np.cumsum(rng.exponential(1.0, num_top))  # descending
        top_ids = np.broadcast_to(np.arange(SIMULATED_TOKEN, SIMULATED_TOKEN + num_top), top_logprobs.shape)
        return top_ids, top_logprobs

    def _beam_step(self, beams: list[Sequence], top_ids, top_logprobs, now: float) -> None:
        group = beams[0].group
        params = group.sampling_params
        stops = group.stop_set
        live, finished = beam_search.select([b.cumulative_logprob for b in beams], top_ids, top_logprobs,
                                            params.n, stops)
        for cand in finished:
            done = beams[cand.parent].fork(-1)
            done.token_ids.append(cand.token)
            done.cumulative_logprob = cand.score
            done.status = SequenceStatus.FINISHED_STOPPED
            group.finished_beams.append(done)
        children: dict[int, list[beam_search.Candidate]] = {}
        for cand in live:
            children.setdefault(cand.parent, []).append(cand)
        for parent_index, parent in enumerate(beams):
            kids = children.get(parent_index, [])
            if not kids:  # dropped beam: give its blocks back
                self.scheduler.free_seq(parent, group)
                group.seqs.remove(parent)
                continue
            forks = [self._fork(group, parent) for _ in kids[1:]]
            for seq, cand in zip([parent] + forks, kids):
                seq.token_ids.append(cand.token)
                seq.cumulative_logprob = cand.score
        if group.first_token_time is None:
            group.first_token_time = now
        for seq in group.live_seqs():
            if seq.num_output_tokens >= params.max_tokens:
                self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                group.finished_beams.append(seq)
        if len(group.finished_beams) >= params.n or not group.live_seqs():
            for seq in group.live_seqs():
                self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
            self._finish_group(group, None, now=now)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        child = parent.fork(next(self._seq_ids))
        self.scheduler.fork_seq(parent, child)
        group.seqs.append(child)
        return child

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.scheduler.free_seq(seq, seq.group)

    def _finish_group(self, group: SequenceGroup, status: SequenceStatus | None, now: float | None = None,
                      error: str | None = None) -> None:
        if status is not None:
            for seq in group.seqs:
                if not seq.status.is_finished:
                    seq.status = status
        group.finish_time = self.executor.now() if now is None else now
        params = group.sampling_params
        if params.use_beam_search and group.finished_beams:
            ranked = sorted(group.finished_beams, key=lambda s: -beam_search.final_score(
                s.cumulative_logprob, s.num_output_tokens, params.length_penalty))[: params.n]
        else:
            ranked = group.seqs
        self._pending_outputs.append(RequestOutput(
            group.request_id, group.seqs[0].token_ids[: group.prompt_len] if group.seqs else [],
            [s.output_token_ids for s in ranked], [s.cumulative_logprob for s in ranked],
            [s.status.label for s in ranked], group.arrival_time, group.first_scheduled_time,
            group.first_token_time, group.finish_time, error))
        del self._groups[group.request_id]
        self._num_multi_seq_groups -= not group.is_single

    def _drain_outputs(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # ------------------------------------------------------------------ conveniences

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serves `prompts` to completion; outputs come back in prompt order."""
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        base = len(self._groups) + self.num_steps
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params):
            self.add_request(request_id, prompt, p)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(prompts), desc="generate", disable=not use_tqdm)
        start = time.perf_counter()
        while self.has_unfinished() and len(results) < len(prompts):
            for output in self.step():
                results[output.request_id] = output
                bar.update(1)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(prefill_tok_s=f"{self.num_prefill_tokens / elapsed:.0f}",
                            decode_tok_s=f"{self.num_decode_tokens / elapsed:.0f}",
                            kv=f"{self.scheduler.block_manager.usage():.0%}", refresh=False)
        bar.close()
        return [results[i] for i in ids]

    def kv_stats(self) -> dict:
        """Block pool and preemption counters."""
        bm = self.scheduler.block_manager
        return {
            "num_total_blocks": bm.num_usable_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_host_blocks": bm.num_host_blocks,
            "num_free_host_blocks": bm.num_free_host_blocks,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_usage": bm.usage(),
            "num_compilations": getattr(self.executor, "num_compilations", 0),
            **self.prefix_cache_stats(),
        }

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache hit rate (cached tokens / prompt tokens admitted), cached blocks, evictions."""
        scheduler = self.scheduler
        cache = getattr(scheduler.block_manager, "prefix_cache", None)
        return {
            "prefix_cache_hit_rate": scheduler.num_cached_tokens / max(scheduler.num_prompt_tokens, 1),
            "prefix_cached_tokens": scheduler.num_cached_tokens,
            "prefix_cached_blocks": cache.num_cached_blocks if cache is not None else 0,
            "prefix_cache_evictions": cache.num_evictions if cache is not None else 0,
        }


def _default_executor(config: EngineConfig) -> Executor:
    if config.executor == "jax":
        from jpaged.executors.jax import JaxExecutor

        return JaxExecutor(config)
    raise ValueError(f"executor {config.executor!r} needs explicit construction (pass executor=...)")
