"""StepPlan: everything one engine step hands to the executor — the host/device seam.

The scheduler decides *what* runs; the StepPlan says it in numpy arrays padded to a few bucket
sizes, so that the jitted model step sees a handful of shapes and steady-state serving does not
recompile. One plan describes any mix of prompt chunks and decodes: sequence s computes its
context's last q_s tokens (q_s = 1 for a decode, more for a prompt chunk); `max_query_len == 1`
is the decode fast path. Pure numpy: no jax import here.

Padding conventions (the kernels rely on them):
- Padded tokens carry token id 0, position 0 and a slot inside reserved block 0, so their K/V
  writes land in a block no live sequence ever owns.
- Padded sequences have context length 0, an empty query range and a block table row of zeros.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jpaged.core.decode_batch import DecodeBatch
    from jpaged.core.kv_manager import KVCacheManager
    from jpaged.core.sequence import Sequence

_EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int32)
_EMPTY_PAIRS.flags.writeable = False


@functools.lru_cache(maxsize=4096)  # (called several times a step: a cached answer is four times cheaper)
def bucket(n: int, minimum: int = 8) -> int:
    """The padded size of a dimension of length n: max(n, minimum) rounded up to a multiple of a
    quarter of the power of two below it, i.e. two sizes per doubling above 4 (8, 12, 16, 24, 32,
    48, 64, 96, ... 1,024, 1,536, 2,048). Padding then wastes at most a third (powers of two waste
    up to half: 33 sequences ran as 64, a 1,476-token prefill as 2,048) while the compiled shapes
    stay few, two per doubling (four per doubling doubled the compile time of the engine tests)."""
    n = max(n, minimum)
    step = 1 << max(0, (n - 1).bit_length() - 2)
    return -(-n // step) * step


@functools.lru_cache(maxsize=4096)
def _decode_ranges(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(query_start_loc i32[size + 1], logits_indices i32[size]) of a decode step of n sequences
    padded to size: sequence s owns token row s; padded sequences own none. Read-only, shared."""
    query_start_loc = np.minimum(np.arange(size + 1, dtype=np.int32), n)
    logits_indices = np.arange(size, dtype=np.int32)
    query_start_loc.flags.writeable = logits_indices.flags.writeable = False
    return query_start_loc, logits_indices


def pairs_array(pairs: list[tuple[int, int]]) -> np.ndarray:
    """An i32[P, 2] array of block pairs (an empty list gives shape [0, 2])."""
    if not pairs:
        return _EMPTY_PAIRS
    return np.asarray(pairs, dtype=np.int32).reshape(-1, 2)


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling settings as arrays; row r samples from logits row `logits_rows[r]`."""

    logits_rows: np.ndarray  # i32[R] which logits row each sample reads (a prompt row repeats for n > 1)
    temperature: np.ndarray  # f32[R] 0 = greedy
    top_k: np.ndarray  # i32[R] 0 = off
    top_p: np.ndarray  # f32[R] 1 = off
    seed: np.ndarray  # u32[R] the request's seed
    stream: np.ndarray  # i32[R] the request's stream base + the sample's index in its group
    position: np.ndarray  # i32[R] position of the token being sampled
    num_top: int = 0  # also return the top `num_top` log-probabilities per row (beams; SamplingParams.logprobs)


@dataclasses.dataclass
class SampleRows:
    """Which sequences sample a token after the step, and from which logits row.

    Usually one row per sequence that computed its last token. A fresh prompt of a request with
    n > 1 samples gets n rows reading its logits (rows with index > 0 become forks), and beam
    rows also ask for their top candidates.
    """

    seqs: list[Sequence]  # [R] the sequence each row extends (a fresh prompt's, for all its n samples)
    logits_rows: np.ndarray  # i32[R] the batch row whose logits it reads
    indices: list[int] | None  # [R] sample index in the group; None: each sequence's own index
    num_top: int  # top candidates per row (2 x the widest beam); 0 without beams
    is_plain: bool  # one row per sequence, no beams, no forks: tokens are appended as they come
    first_token_groups: list  # requests whose first output token this step samples
    # Set when the first `num_batch_rows` rows are the running batch's decodes, in its order, and
    # their ends are known but for stop tokens: such a row ends by sampling one of `stop_tokens`,
    # or by reaching its length limit exactly when it is in `length_stops` (the stop checks then
    # test the batch at once). The other rows (prompts, in a mixed step) are checked one by one.
    stop_tokens: frozenset[int] | None = None
    token_lists: list[list[int]] | None = None  # [B] each batch row's `seq.token_ids`
    length_stops: list[int] = dataclasses.field(default_factory=list)  # batch rows this step's token brings to their length limit
    decode_batch: DecodeBatch | None = None  # the running batch
    num_batch_rows: int = 0  # B

    def __len__(self) -> int:
        return len(self.seqs)

    @functools.cached_property
    def batch(self) -> SamplingBatch:
        """The rows' sampling settings as arrays (built on first use: the simulator never asks)."""
        seqs = self.seqs
        params = [s.group.sampling_params for s in seqs]
        indices = self.indices if self.indices is not None else [s.index for s in seqs]
        num_logprobs = max((p.logprobs or 0 for p in params), default=0)
        return SamplingBatch(
            logits_rows=self.logits_rows.astype(np.int32),
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            seed=np.array([s.group.seed for s in seqs], np.uint32),
            stream=np.array([(s.group.stream_base + i) & 0x7FFFFFFF for s, i in zip(seqs, indices)], np.int32),
            position=np.array([len(s) for s in seqs], np.int32),
            num_top=max(self.num_top, num_logprobs))


@dataclasses.dataclass
class StepPlan:
    """One step's batch as padded numpy arrays plus the block operations to apply before it.

    T = padded token count, S = padded sequence count, M = padded blocks per sequence.
    """

    num_seqs: int  # real sequences in the batch (rows [0, num_seqs) of the per-sequence arrays)
    num_tokens: int  # real tokens in the batch (rows [0, num_tokens) of the per-token arrays)
    max_query_len: int  # most tokens one sequence computes (1: a decode-only step, T == S)
    token_ids: np.ndarray  # i32[T] input token of each row
    positions: np.ndarray  # i32[T] position of each token in its sequence
    slot_mapping: np.ndarray  # i32[T] KV slot each token's K/V is written to (padding -> block 0)
    query_start_loc: np.ndarray  # i32[S + 1] sequence s owns token rows [qsl[s], qsl[s+1])
    context_lens: np.ndarray  # i32[S] tokens of context after this step's writes (0 = padding)
    block_tables: np.ndarray  # i32[S, M] physical block of each logical block (padding -> 0)
    logits_indices: np.ndarray  # i32[S] token row whose logits each sequence may sample from
    sampling: SampleRows | None = None  # who samples after the step (None: nobody)
    num_prefill_tokens: int = 0  # real tokens that are prompt chunks (or recomputed history), not decodes
    copy_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (src, dst) device blocks, copy-on-write
    swap_in_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (host, device) blocks to copy in
    swap_out_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (device, host) blocks to copy out
    seqs: list[Sequence] = dataclasses.field(default_factory=list)  # the batch's sequences, row by row

    @property
    def padded_shape(self) -> tuple[int, int, int]:
        """(T, S, M): the bucketed shape the jitted step is compiled for."""
        return (len(self.token_ids), len(self.context_lens), self.block_tables.shape[1])

    @property
    def is_empty(self) -> bool:
        """True when no sequence runs this step (only block operations, if any)."""
        return self.num_seqs == 0

    @property
    def has_block_ops(self) -> bool:
        """True when the step copies or swaps blocks."""
        return bool(len(self.copy_pairs) or len(self.swap_in_pairs) or len(self.swap_out_pairs))

    @property
    def query_lens(self) -> np.ndarray:
        """i32[num_seqs] tokens each real sequence computes this step."""
        return np.diff(self.query_start_loc[: self.num_seqs + 1])


def batch_plan(batch: DecodeBatch, state: np.ndarray, tables: np.ndarray, swap_in: list[tuple[int, int]] = (),
               swap_out: list[tuple[int, int]] = ()) -> StepPlan:
    """The running batch's decode step alone (no forks, no block copies): its cursor's arrays as
    they are (state i32[3, S]: positions, slots, context lengths; tables i32[S, M]), the token
    ids, and what the batch knows about stops. (A group swapped in mid-prompt adds swap-in pairs
    but no rows; one preempted by swap, swap-out pairs.)"""
    seqs, token_lists = batch.handed_out()
    n, size = len(seqs), state.shape[1]
    token_ids = np.zeros(size, np.int32)
    token_ids[:n] = batch.last_tokens()
    query_start_loc, logits_indices = _decode_ranges(n, size)
    sampling = SampleRows(seqs, logits_indices[:n], None, 0, True, [], batch.stop_tokens, token_lists,
                          batch.length_stops(), batch, n)
    return StepPlan(n, n, 1, token_ids, state[0], state[1], query_start_loc, state[2], tables, logits_indices,
                    sampling, 0, _EMPTY_PAIRS, pairs_array(swap_in), pairs_array(swap_out), seqs)


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
        self._decodes: tuple[DecodeBatch, np.ndarray, np.ndarray] | None = None
        self._copies: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._swap_out: list[tuple[int, int]] = []

    def add(self, seqs: list[Sequence], rows: np.ndarray, counts: np.ndarray | None, slots: np.ndarray,
            copies: list[tuple[int, int]]) -> None:
        """Adds scheduled sequences: `counts[i]` new tokens each (None: one each, their sampled
        tokens), whose slots are already taken (`kv.num_tokens` includes them)."""
        ends = self.kv.num_tokens.take(rows).tolist()
        if counts is None:
            self._num_decodes += len(seqs)
            self._records += zip(seqs, rows.tolist(), [1] * len(seqs), ends)
        else:
            self._records += zip(seqs, rows.tolist(), counts.tolist(), ends)
        self._slots.append(slots)
        if copies:
            self._copies += copies

    def add_chunk(self, seq: Sequence, row: int, count: int, end: int, slots: np.ndarray,
                  copies: list[tuple[int, int]]) -> None:
        """Adds one sequence's next `count` prompt tokens, up to context `end`, with their slots."""
        self._records.append((seq, row, count, end))
        self._slots.append(slots)
        if copies:
            self._copies += copies

    def add_decodes(self, batch: DecodeBatch, state: np.ndarray, tables: np.ndarray) -> None:
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
        kv = self.kv
        width = min(bucket(-(-longest // kv.block_size)), kv.max_blocks_per_seq)
        # take() along axis 0 copies whole rows in one pass: several times cheaper than fancy
        # indexing with a column slice on batches of tens of rows.
        tables = kv.block_tables.take(rows + [0] * (size - len(rows)), axis=0)
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
        query_start_loc, logits_indices = _decode_ranges(n, size)
        return StepPlan(n, n, 1 if n else 0, token_ids, positions, slot_mapping, query_start_loc, context_lens,
                        self._table(rows, max(ends), size), logits_indices, None, 0, _EMPTY_PAIRS, _EMPTY_PAIRS,
                        _EMPTY_PAIRS, seqs)

    def _mixed_plan(self) -> StepPlan:
        """Any mix: sequence i computes the last q_i positions of its context (q_i = 1 for a
        decode). The running batch's decodes, when they lead, are copied in from their cursor's
        arrays; each record (admissions, chunks: a few sequences) fills its rows with slices, its
        prompt tokens from `Sequence.prompt_array`."""
        kv, records = self.kv, self._records
        n_b = 0 if self._decodes is None else len(self._decodes[0].seqs)  # the batch's rows lead
        n = n_b + len(records)
        counts = [count for _, _, count, _ in records]
        ends = [end for _, _, _, end in records]  # context of each record after this step's writes
        total, longest_query = n_b + sum(counts), max(counts)
        size_s = bucket(n)
        # Per-token rows (one allocation): token ids, positions, slots. One token each: T == S.
        per_token = np.zeros((3, size_s if longest_query == 1 else bucket(total, minimum=16)), np.int32)
        token_ids, positions, slot_mapping = per_token
        context_lens = np.zeros(size_s, np.int32)
        query_start_loc = np.empty(size_s + 1, np.int32)
        query_start_loc[0] = 0
        query_start_loc[n + 1:] = total  # padded sequences own no rows
        seqs: list[Sequence] = []
        # Block-table columns: bucketed to the longest context (the batch's tables already are).
        width = min(bucket(-(-max(ends) // kv.block_size)), kv.max_blocks_per_seq)
        if n_b:
            batch, state, batch_tables = self._decodes
            seqs += batch.seqs
            token_ids[:n_b] = batch.last_tokens()
            per_token[1:, :n_b] = state[:2, :n_b]  # positions, slots
            context_lens[:n_b] = state[2, :n_b]
            query_start_loc[1: n_b + 1] = _decode_ranges(n_b, bucket(n_b))[0][1: n_b + 1]  # one row each
            width = max(width, batch_tables.shape[1])
        every_position = _arange(kv.max_blocks_per_seq * kv.block_size)
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
        tables[n_b:n] = kv.block_tables.take([row for _, row, _, _ in records], axis=0)[:, :width]
        return StepPlan(n, total, longest_query, token_ids, positions, slot_mapping, query_start_loc, context_lens,
                        tables, logits_indices, None, 0, _EMPTY_PAIRS, _EMPTY_PAIRS, _EMPTY_PAIRS, seqs)

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
            fan_out = params.n if (params.n > 1 and not params.use_beam_search and group.is_fresh) else 1
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
            logits_rows = _decode_ranges(n, bucket(n))[1][:n]
        else:
            logits_rows = np.array(list(range(offset)) + logits_rows, np.int32)
        rows = SampleRows(seqs, logits_rows, None if all_single else indices, num_top, plain, firsts)
        if offset and all_single:  # the batch's rows lead: what it knows of their stops holds
            batch = self._decodes[0]
            rows.stop_tokens, rows.token_lists = batch.stop_tokens, batch.handed_out()[1]
            rows.length_stops, rows.decode_batch, rows.num_batch_rows = batch.length_stops(), batch, offset
        return rows


@functools.lru_cache(maxsize=8)
def _arange(n: int) -> np.ndarray:
    """i32[n] 0, 1, ..., n - 1 (read-only, shared)."""
    values = np.arange(n, dtype=np.int32)
    values.flags.writeable = False
    return values
