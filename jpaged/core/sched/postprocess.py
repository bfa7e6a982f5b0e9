"""What happens after a step: sampled tokens appended, forks, beam steps, stop checks, frees, outputs.

The core half of the engine loop (vLLM v1's `Scheduler.update_from_output`): the executor ran the
plan and sampled one token per sample row; here the rows become tokens of their sequences. A
fresh prompt of a request with n samples forks n - 1 children sharing its blocks; a beam group
ranks its candidates and forks or drops beams; every sequence is checked against its stop tokens,
max_tokens and max_model_len; finished sequences give their blocks back (full ones stay in the
prefix cache); finished requests, and streaming ones that moved, become RequestOutputs. A
sequence with a constraint (structured outputs: jpaged.core.constraints) advances it past each
token it appends and ends when it terminates; a request with best_of > n reports its n samples of
best cumulative log-probability. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import logging

from jpaged.core.sched import beam_search
from jpaged.core.outputs import CompletionOutput, RequestOutput
from jpaged.core.sched.scheduler import Scheduler, SchedulerOutput
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from jpaged.core.sched.step_guard import describe
from jpaged.core.step_plan import ModelOutput, PromptLogprobs, PromptRows

logger = logging.getLogger(__name__)


class Postprocessor:
    """Applies executed steps to the scheduler's sequences and collects the outputs to report."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.outputs: list[RequestOutput] = []  # reported by the next `drain`
        # The features of the unfinished requests it holds (`track` counts them in, `_untrack` out):
        # a step none of them needs skips the per-row work they cost.
        self.num_streaming = 0  # with output_kind "delta" / "cumulative"
        self.num_logprobs = 0  # that asked for logprobs
        self.num_constrained = 0  # with a constraint (their tokens are applied row by row)

    def track(self, group: SequenceGroup) -> None:
        """Counts a new request's features in (the engine calls it as the request is queued)."""
        self._count(group.sampling_params, 1)

    def _count(self, params: SamplingParams, sign: int) -> None:
        self.num_streaming += sign * (params.output_kind != "final")
        self.num_logprobs += sign * (params.logprobs is not None)
        self.num_constrained += sign * (params.constraint is not None)

    def update(self, out: SchedulerOutput, result: ModelOutput, started: float, now: float) -> None:
        """Applies one executed step: `started` and `now` are the clock at its start and end."""
        for group in out.admitted:
            if group.first_scheduled_time is None:
                group.first_scheduled_time = started
        if out.plan.prompt_rows is not None and result.prompt_logprobs is not None:
            self._record_prompt_logprobs(out.plan.prompt_rows, result.prompt_logprobs)
        rows = out.plan.sampling
        if rows is not None:
            tokens = result.token_ids
            tokens = tokens if isinstance(tokens, list) else tokens.tolist()
            logprobs = None if result.logprobs is None else result.logprobs.tolist()
            for group in rows.first_token_groups:
                group.first_token_time = now
            num_batch = rows.num_batch_rows
            batch_tokens = tokens if num_batch == len(tokens) else tokens[:num_batch]
            if rows.spec_offsets is not None:
                self._apply_verified(rows, tokens, logprobs, result, now)
            elif (rows.stop_tokens is not None and not self.num_logprobs and not self.num_constrained
                    and rows.stop_tokens.isdisjoint(batch_tokens)):
                # The steady state: no batch row samples a stop token, so their tokens are
                # appended as they come, and only the rows known to reach their length limit end.
                for ids, token in zip(rows.token_lists, batch_tokens):
                    ids.append(token)
                out.batch.sampled(batch_tokens)  # the next step's input ids
                if logprobs is not None:
                    for seq, logprob in zip(rows.seqs, logprobs[:num_batch]):
                        seq.cumulative_logprob += logprob
                for r in rows.length_stops:
                    self._end_seq(rows.seqs[r], False, now)
                if num_batch < len(tokens):  # the prompts of a mixed step: row by row
                    self._append_all(rows.seqs[num_batch:], tokens[num_batch:],
                                     None if logprobs is None else logprobs[num_batch:], now)
            elif rows.is_plain:
                if self.num_logprobs and logprobs is not None:
                    self._record_logprobs(rows.seqs, range(len(tokens)), tokens, logprobs, result)
                self._append_all(rows.seqs, tokens, logprobs, now)
            else:
                self._apply_rows(rows, tokens, logprobs, result, now)
            if self.num_streaming:
                for group in {id(s.group): s.group for s in rows.seqs}.values():
                    if group.sampling_params.output_kind != "final" and not group.is_finished:
                        self.outputs.append(self.output_of(group, finished=False))
        self.scheduler.remove_finished()

    def drain(self) -> list[RequestOutput]:
        """The outputs collected since the last drain."""
        outputs, self.outputs = self.outputs, []
        return outputs

    def _apply_rows(self, rows, tokens: list[int], logprobs: list[float] | None, result: ModelOutput,
                    now: float) -> None:
        """The general case: forks of fresh prompts and beam groups."""
        seqs = list(rows.seqs)
        plain: list[int] = []
        beams: dict[int, list[int]] = {}  # id(group) -> its rows
        for r, (seq, index) in enumerate(zip(rows.seqs, rows.indices)):
            group = seq.group
            if group.sampling_params.use_beam_search:
                beams.setdefault(id(group), []).append(r)
                continue
            if index != seq.index:  # a fresh prompt's extra sample: a fork sharing its blocks
                if group.finish_time is not None:  # an earlier fork of it failed
                    continue
                try:
                    seqs[r] = self._fork(group, seq, index)
                except Exception as exc:
                    self.fail_group(group, now, f"forking sample {index} failed: {describe(exc)}")
                    continue
            plain.append(r)
        for indices in beams.values():
            beams_of_group = [seqs[r] for r in indices]
            try:
                self._beam_step(beams_of_group, result.top_ids[indices], result.top_logprobs[indices], now)
            except Exception as exc:
                self.fail_group(beams_of_group[0].group, now, f"beam search step failed: {describe(exc)}")
        plain = [r for r in plain if seqs[r].group.finish_time is None]
        if self.num_logprobs and logprobs is not None:
            self._record_logprobs([seqs[r] for r in plain], plain, [tokens[r] for r in plain], logprobs, result)
        self._append_all([seqs[r] for r in plain], [tokens[r] for r in plain],
                         None if logprobs is None else [logprobs[r] for r in plain], now)

    def _apply_verified(self, rows, tokens: list[int], logprobs: list[float] | None, result: ModelOutput,
                        now: float) -> None:
        """A verify step (jpaged.core.sched.speculation): per sequence, the drafts its samples
        accept and the one token after them are appended one by one (each through the stop checks:
        a stop ends the sequence there), once its slots past the verified tokens are given back."""
        scheduler = self.scheduler
        offsets = rows.spec_offsets
        drafts = rows.spec_drafts if result.drafts is None else result.drafts.tolist()
        start, num_rows = 0, len(tokens)
        while start < num_rows:
            end = start + 1
            while end < num_rows and offsets[end]:
                end += 1
            seq = rows.seqs[start]
            accepted = scheduler.speculator.verified(drafts[start: end - 1], tokens[start:end])
            if seq.group.finish_time is None and not seq.status.is_finished:  # (one that failed takes nothing)
                # Slots of the tokens before the emitted ones: the verified history holds their K/V.
                scheduler.block_manager.trim(seq.seq_id, len(seq.token_ids) + accepted)
                for r in range(start, start + accepted + 1):
                    if self.num_logprobs and logprobs is not None:
                        self._record_logprobs([seq], [r], [tokens[r]], logprobs, result)
                    self._append_all([seq], [tokens[r]], None if logprobs is None else [logprobs[r]], now)
                    if seq.status.is_finished:
                        break
            start = end

    @staticmethod
    def _record_logprobs(seqs: list[Sequence], rows, tokens: list[int], logprobs: list[float],
                         result: ModelOutput) -> None:
        """Per sequence that asked (SamplingParams.logprobs = k): its top k and sampled token's logprobs.

        `rows[i]` is the sample row of `seqs[i]` and `tokens[i]` its token; `logprobs` is per row.
        Runs before the tokens are appended, so a sequence that stops now has its last entry.
        """
        for seq, row, token in zip(seqs, rows, tokens):
            k = seq.group.sampling_params.logprobs
            if k is None:
                continue
            entry = {}
            if k:
                entry = dict(zip(result.top_ids[row, :k].tolist(), result.top_logprobs[row, :k].tolist()))
            entry.setdefault(token, logprobs[row])
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)

    @staticmethod
    def _record_prompt_logprobs(rows: PromptRows, result: PromptLogprobs) -> None:
        """Appends each request's new prompt positions: {prompt token: logprob, then the top k}, as
        vLLM builds them (the prompt's token first; a top entry for the same token overwrites it)."""
        targets = rows.targets.tolist()
        chosen, ranks = result.token_logprobs.tolist(), result.ranks.tolist()
        top_ids, top_logprobs = result.top_ids.tolist(), result.top_logprobs.tolist()
        start = 0
        for group, first, count in rows.groups:
            begin, start = start, start + count
            # (A request that failed, or a position already reported, takes nothing.)
            if group.finish_time is not None or len(group.prompt_logprobs) != first:
                continue
            k = group.sampling_params.prompt_logprobs
            for r in range(begin, start):
                entry = {targets[r]: chosen[r]}
                if k:
                    entry.update(zip(top_ids[r][:k], top_logprobs[r][:k]))
                group.prompt_logprobs.append(entry)
            group.prompt_ranks += ranks[begin:start]

    def _append_all(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float] | None,
                    now: float) -> None:
        """Appends one sampled token per sequence and applies the stop checks.

        Runs for every sequence of every step, so the common path is an append and two compares.
        """
        if self.num_constrained:
            seqs, tokens, logprobs = self._advance_constraints(seqs, tokens, logprobs, now)
        if logprobs is not None:
            for seq, logprob in zip(seqs, logprobs):
                seq.cumulative_logprob += logprob
        for seq, token in zip(seqs, tokens):
            ids = seq.token_ids
            ids.append(token)
            group = seq.group
            if len(ids) < group.max_total_len and token not in group.stop_set:
                continue
            self._end_seq(seq, token in group.stop_set, now)  # reached once per sequence, not per token

    def _advance_constraints(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float] | None,
                             now: float) -> tuple[list[Sequence], list[int], list[float] | None]:
        """Advances each constrained sequence past its token; one whose constraint terminates takes
        the token and ends now ("stop", even on its last allowed token), one whose constraint refuses
        the token fails its request. Returns the rows left for the ordinary append."""
        rest = [i for i, seq in enumerate(seqs) if seq.constraint is None]
        if len(rest) == len(seqs):
            return seqs, tokens, logprobs
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.constraint is None or seq.group.finish_time is not None:
                continue
            try:
                if not seq.constraint.accept(token):
                    raise ValueError(f"token {token} was sampled but its constraint does not allow it")
                if not seq.constraint.is_terminated():
                    rest.append(i)
                    continue
            except Exception as exc:
                self.fail_group(seq.group, now, f"constraint failed: {describe(exc)}")
                continue
            if logprobs is not None:
                seq.cumulative_logprob += logprobs[i]
            seq.token_ids.append(token)
            self._end_seq(seq, True, now)
        rest = sorted(i for i in rest if seqs[i].constraint is None or seqs[i].group.finish_time is None)
        return ([seqs[i] for i in rest], [tokens[i] for i in rest],
                None if logprobs is None else [logprobs[i] for i in rest])

    def _end_seq(self, seq: Sequence, stopped: bool, now: float) -> None:
        """Ends a sequence that sampled a stop token (`stopped`) or reached its length limit, and its
        request when it was the last live one."""
        group = seq.group
        if group.finish_time is not None:  # it failed earlier in this step
            return
        try:
            self._finish_seq(seq, SequenceStatus.FINISHED_STOPPED if stopped else SequenceStatus.FINISHED_LENGTH)
            if group.is_finished:
                self.finish_group(group, now)
        except Exception as exc:
            self.fail_group(group, now, f"finishing failed: {describe(exc)}")

    def _beam_step(self, beams: list[Sequence], top_ids, top_logprobs, now: float) -> None:
        """One beam-search step of a group: candidates ranked, beams forked or dropped, hypotheses kept."""
        group = beams[0].group
        params = group.sampling_params
        live, finished = beam_search.select([b.cumulative_logprob for b in beams], top_ids, top_logprobs,
                                            params.n, group.stop_set)
        for cand in finished:
            done = beams[cand.parent].fork(-1, -1)
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
                self.scheduler.free_seq(parent)
                group.seqs.remove(parent)
                continue
            forks = [self._fork(group, parent, group.num_forks + 1) for _ in kids[1:]]
            for seq, cand in zip([parent] + forks, kids):
                seq.token_ids.append(cand.token)
                seq.cumulative_logprob = cand.score
        for seq in group.live_seqs():
            if seq.num_output_tokens >= params.max_tokens:
                self._finish_seq(seq, SequenceStatus.FINISHED_LENGTH)
                group.finished_beams.append(seq)
        if len(group.finished_beams) >= params.n or not group.live_seqs():
            for seq in group.live_seqs():
                self._finish_seq(seq, SequenceStatus.FINISHED_ABORTED)
            self.finish_group(group, now)

    def _fork(self, group: SequenceGroup, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(self.scheduler.new_seq_id(), index)
        group.num_forks += 1
        self.scheduler.fork_seq(parent, child)
        group.seqs.append(child)
        return child

    def _finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        seq.status = status
        self.scheduler.free_seq(seq)

    def finish_group(self, group: SequenceGroup, now: float, status: SequenceStatus | None = None,
                     error: str | None = None) -> None:
        """Ends a request (its live sequences get `status`, if given) and queues its final output."""
        if status is not None:
            for seq in group.seqs:
                if not seq.status.is_finished:
                    seq.status = status
        group.finish_time = now
        group.error = error
        self._count(group.sampling_params, -1)
        self.outputs.append(self.output_of(group, finished=True))

    def fail_group(self, group: SequenceGroup, now: float, error: str) -> None:
        """Ends a request that failed inside a step on its own data: its blocks are freed, its output
        carries `error`, and the step goes on for the other requests."""
        logger.warning("ending request %s: %s", group.request_id, error)
        self.scheduler.abort(group)
        for seq in group.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
        if group.finish_time is None:
            self._count(group.sampling_params, -1)
        group.finish_time = now
        group.error = error
        try:
            output = self.output_of(group, finished=True)
        except Exception:  # the output is what failed (a beam score, say): the sequences as they are
            output = RequestOutput(group.request_id, group.seqs[0].token_ids[: group.prompt_len] if group.seqs else [],
                                   [CompletionOutput(s.index, s.output_token_ids, s.cumulative_logprob, s.status.label)
                                    for s in group.seqs], True, group.arrival_time, group.first_scheduled_time,
                                   group.first_token_time, now, error)
        # One final output per request: replace one its failure interrupted.
        self.outputs = [o for o in self.outputs if o.request_id != group.request_id] + [output]

    def output_of(self, group: SequenceGroup, finished: bool) -> RequestOutput:
        """The group's RequestOutput now (its samples by index, its beams best first, or with best_of > n
        its n samples of best cumulative log-probability, best first, numbered by rank)."""
        params = group.sampling_params
        ranked = params.use_beam_search or group.width > params.n
        if params.use_beam_search and finished and group.finished_beams:
            seqs = sorted(group.finished_beams, key=lambda s: -beam_search.final_score(
                s.cumulative_logprob, s.num_output_tokens, params.length_penalty))[: params.n]
        elif ranked and not params.use_beam_search:  # best_of (vLLM v0: by cumulative logprob)
            seqs = sorted(group.seqs, key=lambda s: (-s.cumulative_logprob, s.index))[: params.n]
        else:
            seqs = sorted(group.seqs, key=lambda s: s.index)
        delta = params.output_kind == "delta"
        completions = []
        for rank, seq in enumerate(seqs):
            tokens, logprobs = seq.output_token_ids, seq.logprobs
            if delta:
                start, seq.num_reported = seq.num_reported, len(tokens)
                tokens = tokens[start:]
                logprobs = None if logprobs is None else logprobs[start:]
            elif logprobs is not None:
                logprobs = list(logprobs)
            completions.append(CompletionOutput(rank if ranked else seq.index, tokens,
                                                seq.cumulative_logprob,
                                                seq.status.label if seq.status.is_finished else None, logprobs))
        prompt = group.seqs[0].token_ids[: group.prompt_len] if group.seqs else []
        output = RequestOutput(group.request_id, prompt, completions, finished, group.arrival_time,
                               group.first_scheduled_time, group.first_token_time, group.finish_time, group.error)
        if group.prompt_logprobs is not None and not group.wants_prompt_logprobs:
            # Whole once complete (vLLM: all at the end of the prefill); with deltas only the first time.
            if not delta or not group.prompt_logprobs_reported:
                output.prompt_logprobs, output.prompt_ranks = list(group.prompt_logprobs), list(group.prompt_ranks)
            group.prompt_logprobs_reported = True
        return output
