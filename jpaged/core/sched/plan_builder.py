"""How the scheduler fills a StepPlan: its hot path, one record per scheduled sequence.

The running batch's decodes come as its cursor's arrays (`PlanBuilder.add_decodes`, or
`batch_plan` when they run alone); every other scheduled sequence is a record (sequence,
block-table row, new tokens, context after the step) with the slots the KV manager gave its new
tokens. `build` lays them out with the padding rule of `jpaged.core.padding` and decides who
samples (SampleRows). Pure Python + numpy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.padding import arange, bucket, decode_ranges, seq_bucket, table_width, token_bucket
from jpaged.core.step_plan import PromptRows, SampleRows, StepPlan, pairs_array

if TYPE_CHECKING:
    from jpaged.core.sched.persistent_batch import PersistentBatch
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.sequence import Sequence


def batch_plan(batch: PersistentBatch, state: np.ndarray, tables: np.ndarray, swap_in: list[tuple[int, int]] = (),
               swap_out: list[tuple[int, int]] = ()) -> StepPlan:
    """The running batch's decode step alone (no forks, no block copies): its cursor's arrays as
    they are (state i32[3, S]: positions, slots, context lengths; tables i32[S, M]), the token
    ids, and what the batch knows about stops. (A group swapped in mid-prompt adds swap-in pairs
    but no rows; one preempted by swap, swap-out pairs.)"""
    seqs, token_lists = batch.handed_out()
    n, size = len(seqs), state.shape[1]
    token_ids = np.zeros(size, np.int32)
    token_ids[:n] = batch.last_tokens()
    query_start_loc, logits_indices = decode_ranges(n, size)
    sampling = SampleRows(seqs=seqs, logits_rows=logits_indices[:n], indices=None, num_top=0, is_plain=True,
                          first_token_groups=[], stop_tokens=batch.stop_tokens, token_lists=token_lists,
                          length_stops=batch.length_stops(), num_batch_rows=n)
    return StepPlan(num_seqs=n, num_tokens=n, max_query_len=1, token_ids=token_ids, positions=state[0],
                    slot_mapping=state[1], query_start_loc=query_start_loc, context_lens=state[2], block_tables=tables,
                    logits_indices=logits_indices, sampling=sampling, swap_in_pairs=pairs_array(swap_in),
                    swap_out_pairs=pairs_array(swap_out), seqs=seqs)


def verify_plan(kv: KVCacheManager, seqs: list[Sequence], rows: np.ndarray, drafts: list[list[int]],
                slots: np.ndarray, copies: list[tuple[int, int]]) -> StepPlan:
    """A verify step (jpaged.core.sched.speculation): sequence i computes its last token and its
    drafts `drafts[i]` (1 + k_i tokens, whose slots `append_slots` gave: `slots`, row after row),
    and every one of those tokens has a logits row and a sample row, row j of sequence i
    sampling position len(seq) + j. S is at least the token count, so the ragged step
    (`StepPlan.to_ragged`) keeps a logits row per token."""
    store = kv.rows
    counts = [1 + len(d) for d in drafts]
    n, total = len(seqs), sum(counts)
    size_t, size_s = token_bucket(total), seq_bucket(total)
    ends = store.num_tokens.take(rows).tolist()  # each context after the step (the slots just taken included)
    # Python lists first, then one array each: right after a model step has left the caches cold,
    # every numpy call costs several microseconds (a cumsum with `out=` took 20).
    tokens, token_positions, starts = [], [], [0]
    sample_seqs: list[Sequence] = []
    offsets: list[int] = []
    checked: list[int] = []
    for seq, draft, end, count in zip(seqs, drafts, ends, counts):
        tokens.append(seq.token_ids[-1])
        tokens += draft
        token_positions += range(end - count, end)
        starts.append(starts[-1] + count)
        sample_seqs += [seq] * count
        offsets += range(count)
        checked += draft + [-1]
    pad = [0] * (size_t - total)
    token_ids, positions, slot_mapping = np.array([tokens + pad, token_positions + pad, slots.tolist() + pad],
                                                     np.int32)
    query_start_loc = np.array(starts + [total] * (size_s - n), np.int32)
    context_lens = np.array(ends + [0] * (size_s - n), np.int32)
    block_tables = np.zeros((size_s, store.max_blocks_per_seq), np.int32)
    block_tables[:n] = store.block_tables.take(rows, axis=0)
    logits_indices = np.array([*range(total)] + [0] * (size_s - total), np.int32)
    sampling = SampleRows(seqs=sample_seqs, logits_rows=logits_indices[:total], indices=None, num_top=0,
                          is_plain=False, first_token_groups=[], spec_offsets=offsets, spec_drafts=checked)
    return StepPlan(num_seqs=n, num_tokens=total, max_query_len=max(counts), token_ids=token_ids,
                    positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
                    context_lens=context_lens, block_tables=block_tables, logits_indices=logits_indices,
                    sampling=sampling, copy_pairs=pairs_array(copies), seqs=list(seqs))


class PlanBuilder:
    """Collects a step's scheduled rows, then lays them out as a padded StepPlan.

    The running batch's decodes come as its cursor's arrays (`add_decodes`); every other scheduled
    sequence is a record (sequence, block-table row, new tokens, context after the step) with the
    slots `append_slots` gave its new tokens: `add_chunk` for one sequence, `add` for several.
    """

    def __init__(self, kv_manager: KVCacheManager):
        self.kv = kv_manager
        self._records: list[tuple[Sequence, int, int, int]] = []  # (seq, row, new tokens, context after)
        self._slots: list[np.ndarray] = []  # i32 slots of the records' new tokens, record after record
        self._num_decodes = 0  # records that run a sampled token (not a prompt chunk)
        # (running batch, its step arrays, block tables) when the batch's decodes lead the step
        self._decodes: tuple[PersistentBatch, np.ndarray, np.ndarray] | None = None
        self._copies: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []
        self._prompt_logprobs = False  # some record's request wants prompt log-probabilities

    def add(self, seqs: list[Sequence], rows: np.ndarray, counts: np.ndarray | None, slots: np.ndarray,
            copies: list[tuple[int, int]]) -> None:
        """Adds scheduled sequences: `counts[i]` new tokens each (None: one each, their sampled
        tokens), whose slots are already taken (`kv.rows.num_tokens` includes them)."""
        ends = self.kv.rows.num_tokens.take(rows).tolist()
        if counts is None:
            self._num_decodes += len(seqs)
            self._records += zip(seqs, rows.tolist(), [1] * len(seqs), ends)
        else:
            self._records += zip(seqs, rows.tolist(), counts.tolist(), ends)
            self._prompt_logprobs = self._prompt_logprobs or any(s.group.wants_prompt_logprobs for s in seqs)
        self._slots.append(slots)
        if copies:
            self._copies += copies

    def add_chunk(self, seq: Sequence, row: int, count: int, end: int, slots: np.ndarray,
                  copies: list[tuple[int, int]]) -> None:
        """Adds one sequence's next `count` prompt tokens, up to context `end`, with their slots."""
        self._records.append((seq, row, count, end))
        self._slots.append(slots)
        self._prompt_logprobs = self._prompt_logprobs or seq.group.wants_prompt_logprobs
        if copies:
            self._copies += copies

    def add_decodes(self, batch: PersistentBatch, state: np.ndarray, tables: np.ndarray) -> None:
        """Adds the running batch's decodes, one token each, as the step's first rows, with the
        arrays its cursor's step returned: state i32[3, S] (positions, slots, context lengths),
        tables i32[S, M]."""
        self._decodes = batch, state, tables

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host-to-device block copies to apply before the step."""
        self._swap_in += pairs

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device-to-host block copies to apply before the step (before any swap-in reuses blocks)."""
        self._swap_out += pairs

    @property
    def leading_batch(self) -> PersistentBatch | None:
        """The running batch, when its decodes were added (they lead the plan's rows)."""
        return None if self._decodes is None else self._decodes[0]

    def build(self, all_single: bool) -> StepPlan:
        """The padded plan. `all_single`: no running group has several sequences (no beams, no forks)."""
        if not self._records:
            if self._decodes is not None:
                return batch_plan(*self._decodes, self._swap_in, self._swap_out)  # the batch decodes, alone
            plan = self._decode_plan()  # nothing runs: block operations only, if any
        elif self._decodes is None and self._num_decodes == len(self._records):
            plan = self._decode_plan()  # decodes only (forks, swapped-in groups)
        else:
            plan = self._mixed_plan()
        plan.sampling = self._sample_rows(all_single)
        if self._prompt_logprobs:
            plan.prompt_rows = self._prompt_rows(plan.query_start_loc[plan.num_seqs - len(self._records):])
        plan.num_prefill_tokens = plan.num_tokens - plan.num_seqs + len(self._records) - self._num_decodes
        if self._copies:
            plan.copy_pairs = pairs_array(self._copies)
        if self._swap_in:
            plan.swap_in_pairs = pairs_array(self._swap_in)
        if self._swap_out:
            plan.swap_out_pairs = pairs_array(self._swap_out)
        return plan

    def _table(self, rows: list[int], longest: int, size: int) -> np.ndarray:
        """i32[size, M] the rows' block tables, M bucketed to the longest context, padding rows 0."""
        kv, store = self.kv, self.kv.rows
        width = table_width(-(-longest // kv.block_size), store.max_blocks_per_seq)
        # take() along axis 0 copies whole rows in one pass: several times cheaper than fancy
        # indexing with a column slice on batches of tens of rows.
        tables = store.block_tables.take(rows + [0] * (size - len(rows)), axis=0)
        return tables if width == tables.shape[1] else np.ascontiguousarray(tables[:, :width])

    def _decode_plan(self) -> StepPlan:
        """The records (if any) compute one token each, their last: T == S."""
        records = self._records
        n = len(records)
        size = bucket(n)
        # One allocation for the four per-row vectors.
        token_ids, positions, slot_mapping, context_lens = np.zeros((4, size), np.int32)
        if n:
            seqs, rows, _, ends = map(list, zip(*records))
            context_lens[:n] = ends
            np.subtract(context_lens[:n], 1, out=positions[:n])
            np.concatenate(self._slots, out=slot_mapping[:n])
            token_ids[:n] = [s.token_ids[-1] for s in seqs]
        else:
            seqs, rows, ends = [], [], [1]
        query_start_loc, logits_indices = decode_ranges(n, size)
        return StepPlan(num_seqs=n, num_tokens=n, max_query_len=1 if n else 0, token_ids=token_ids,
                        positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
                        context_lens=context_lens, block_tables=self._table(rows, max(ends), size),
                        logits_indices=logits_indices, seqs=seqs)

    def _mixed_plan(self) -> StepPlan:
        """Any mix: sequence i computes the last q_i positions of its context (q_i = 1 for a
        decode). The running batch's decodes, when they lead, are copied in from their cursor's
        arrays; each record (admissions, chunks: a few sequences) fills its rows with slices, its
        prompt tokens from `Sequence.prompt_array`."""
        kv, store, records = self.kv, self.kv.rows, self._records
        n_b = 0 if self._decodes is None else len(self._decodes[0].seqs)  # the batch's rows lead
        n = n_b + len(records)
        counts = [count for _, _, count, _ in records]
        ends = [end for _, _, _, end in records]  # context of each record after this step's writes
        total, longest_query = n_b + sum(counts), max(counts)
        size_s = seq_bucket(n) if longest_query > 1 else bucket(n)
        # Per-token rows (one allocation): token ids, positions, slots.
        per_token = np.zeros((3, token_bucket(total)), np.int32)
        token_ids, positions, slot_mapping = per_token
        context_lens = np.zeros(size_s, np.int32)
        query_start_loc = np.empty(size_s + 1, np.int32)
        query_start_loc[0] = 0
        query_start_loc[n + 1:] = total  # padded sequences own no rows
        seqs: list[Sequence] = []
        # Block-table columns: the full width with a prompt chunk, else bucketed to the longest
        # context (the batch's tables already are); the executor runs every plan at the full width.
        width = (store.max_blocks_per_seq if longest_query > 1
                 else table_width(-(-max(ends) // kv.block_size), store.max_blocks_per_seq))
        if n_b:
            batch, state, batch_tables = self._decodes
            seqs += batch.seqs
            token_ids[:n_b] = batch.last_tokens()
            per_token[1:, :n_b] = state[:2, :n_b]  # positions, slots
            context_lens[:n_b] = state[2, :n_b]
            query_start_loc[1: n_b + 1] = decode_ranges(n_b, bucket(n_b))[0][1: n_b + 1]  # one row each
            width = max(width, batch_tables.shape[1])
        every_position = arange(store.max_blocks_per_seq * kv.block_size)
        start = n_b
        for i, (seq, _, count, end) in enumerate(records, n_b + 1):
            seqs.append(seq)
            stop = start + count
            if count == 1:  # a decode (or a one-token chunk)
                token_ids[start] = seq.token_ids[end - 1]
            else:
                token_ids[start:stop] = (seq.prompt_array[end - count: end] if end <= seq.prompt_len
                                         else seq.token_ids[end - count: end])
            positions[start:stop] = every_position[end - count: end]
            query_start_loc[i] = stop
            start = stop
        np.concatenate(self._slots, out=slot_mapping[n_b:total])
        context_lens[n_b:n] = ends
        logits_indices = query_start_loc[1:] - 1
        logits_indices[n:] = 0
        # Block tables: the batch's from its cursor, the records' gathered.
        tables = np.zeros((size_s, width), np.int32)
        if n_b:
            tables[:n_b, : batch_tables.shape[1]] = batch_tables[:n_b]
        tables[n_b:n] = store.block_tables.take([row for _, row, _, _ in records], axis=0)[:, :width]
        return StepPlan(num_seqs=n, num_tokens=total, max_query_len=longest_query, token_ids=token_ids,
                        positions=positions, slot_mapping=slot_mapping, query_start_loc=query_start_loc,
                        context_lens=context_lens, block_tables=tables, logits_indices=logits_indices, seqs=seqs)

    def _prompt_rows(self, starts: np.ndarray) -> PromptRows | None:
        """The token rows of the records whose requests want prompt log-probabilities (record i's
        rows begin at `starts[i]`): a row at position p predicts prompt token p + 1, so a record
        computing positions [end - count, end) gives the prompt positions [end - count + 1, end]
        it has none for yet, below the prompt's length."""
        token_rows, targets, groups, num_top = [], [], [], 0
        for (seq, _, count, end), start in zip(self._records, starts.tolist()):
            group = seq.group
            if not group.wants_prompt_logprobs:
                continue
            first, stop = max(len(group.prompt_logprobs), end - count + 1), min(seq.prompt_len, end + 1)
            if first >= stop:
                continue
            row_of_first = start + first - 1 - (end - count)
            token_rows.append(np.arange(row_of_first, row_of_first + stop - first, dtype=np.int32))
            targets.append(seq.prompt_array[first:stop])
            groups.append((group, first, stop - first))
            num_top = max(num_top, group.sampling_params.prompt_logprobs)
        if not groups:
            return None
        return PromptRows(token_rows=np.concatenate(token_rows),
                          targets=np.concatenate(targets), num_top=num_top, groups=groups)

    def _sample_rows(self, all_single: bool) -> SampleRows | None:
        """Rows to sample: every sequence that computed its last token (see SampleRows). The
        batch's decodes all sample; a record samples when its context reaches its end (a chunk
        that stops short does not). With `all_single` no row forks or searches beams. (The batch
        decodes through its cursor only while no running group had several sequences: its rows
        neither fork nor search beams, though a group admitted after them in the step may.)"""
        seqs: list[Sequence] = []
        logits_rows: list[int] = []
        indices: list[int] = []
        firsts: list = []
        num_top = 0
        plain = True
        offset = 0
        if self._decodes is not None:  # (their logits rows 0 .. offset - 1 are prepended below)
            seqs += self._decodes[0].seqs
            offset = len(seqs)
            if not all_single:
                indices += [s.index for s in seqs]
        each_once = True  # every record samples one row
        for row, (seq, _, _, end) in enumerate(self._records, offset):
            if end != len(seq.token_ids):
                each_once = False
                continue  # a prompt chunk that does not reach its end: nothing to sample yet
            group = seq.group
            if group.first_token_time is None:
                firsts.append(group)
            params = group.sampling_params
            if all_single:
                seqs.append(seq)
                logits_rows.append(row)
                continue
            if params.use_beam_search:
                num_top = max(num_top, 2 * params.n)
                plain = False
            fan_out = group.width if (group.width > 1 and not params.use_beam_search and group.is_fresh) else 1
            plain = plain and fan_out == 1
            each_once = each_once and fan_out == 1
            for i in range(fan_out):
                seqs.append(seq)
                logits_rows.append(row)
                indices.append(i if fan_out > 1 else seq.index)
        if not seqs:
            return None
        if each_once:  # sequence i samples once, from logits row i
            n = offset + len(self._records)
            logits_rows = decode_ranges(n, bucket(n))[1][:n]
        else:
            logits_rows = np.array(list(range(offset)) + logits_rows, np.int32)
        rows = SampleRows(seqs=seqs, logits_rows=logits_rows, indices=None if all_single else indices,
                          num_top=num_top, is_plain=plain, first_token_groups=firsts)
        if offset and all_single:  # the batch's rows lead: what it knows of their stops holds
            batch = self._decodes[0]
            rows.stop_tokens, rows.token_lists = batch.stop_tokens, batch.handed_out()[1]
            rows.length_stops, rows.num_batch_rows = batch.length_stops(), offset
        return rows
