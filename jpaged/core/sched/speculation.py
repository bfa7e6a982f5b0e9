"""Speculative decoding's host half: drafts, the verify step's acceptance rule and its counters.

A decoding sequence of L tokens holds the KV of its first L - 1; its next step computes token L - 1.
With speculation, a proposer drafts d_1..d_k (prompt lookup: `NgramIndex`, `ngram_draft` its
plain reference; or a draft model, run by the executor just before the verify step:
`PLACEHOLDER`), and one verify step computes the k + 1 tokens t_{L-1}, d_1..d_k, writing their
K/V into slots reserved like any prompt chunk's (`BlockManager.append_slots`: new blocks,
copy-on-write of a shared last block).
Row j of the sequence samples position L + j as a decode would (`x_j`, drawn from the target
model's distribution with the key (seed, stream, L + j)). The drafts are accepted while they equal
those samples (`accepted_length`): with a = the accepted count the step emits d_1..d_a and x_a
(the correction where d_{a+1} was rejected, the bonus token where all were accepted), and the
slots past the verified tokens are given back (`BlockManager.trim`).

Why this is the standard rule (Leviathan et al. 2023; Chen et al. 2023) and exact: a draft that is
one token (a point mass q = 1[d]) is accepted with probability min(1, p(d) / q(d)) = p(d), and on
rejection the standard rule samples from norm(max(0, p - q)), which is p without d. Drawing x ~ p
and accepting when x == d gives the same: accepted with probability p(d), and x given x != d is p
without d. (vLLM's rejection sampler treats n-gram drafts as one-hot the same way.) Because x_j is
the very draw a decode of position L + j makes, a sequence's tokens with speculation are the
tokens it gets without: greedy and seeded sampling alike, up to the floating-point difference of
scoring k + 1 tokens in one step instead of one per step.

Rows whose sampling reads the sequence's own history (penalties, logit_bias with bad words,
min_tokens, allowed ids, grammars) get no drafts: their row j would need the history extended by
d_1..d_j. They decode one token in the verify step beside the others. Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jpaged.config import SpeculativeConfig

if TYPE_CHECKING:
    from jpaged.core.sequence import Sequence

# A draft token the executor's draft model fills in (method draft_model): the verify plan carries
# it at the draft's token row and in `SampleRows.spec_drafts`; `ModelOutput.drafts` brings the
# drafts back.
PLACEHOLDER = -1


def ngram_draft(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: for n from `max_n` down to `min_n`, the first earlier occurrence of the last
    n tokens of `token_ids` proposes the (at most `k`) tokens that followed it; [] when no suffix
    of those lengths occurs earlier. (vLLM's rule: the first occurrence is where a copied text
    came from, where later ones are often the copy's own short repeats.)"""
    tokens = np.asarray(token_ids, dtype=np.int32)
    length = len(tokens)
    if length < 2 or min_n > length - 1:
        return []
    # Candidate ends: every earlier e (e <= length - 2, so a token follows it) with tokens[e] equal
    # to the last token; then each look-back j keeps those whose token j before also matches. One
    # pass over the sequence, then work on the few candidates only (this runs on the host each step).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # i32[C], ascending
    matched = np.ones(len(ends), np.int32)  # [C] how many suffix tokens each candidate matched, <= max_n
    alive = np.ones(len(ends), bool)
    for j in range(1, min(max_n, length - 1)):
        alive &= ends >= j
        alive[alive] = tokens[ends[alive] - j] == tokens[length - 1 - j]
        if not alive.any():
            break
        matched += alive
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = ends[matched >= n]
        if len(hits):
            start = int(hits[0]) + 1
            return tokens[start: start + k].tolist()
    return []


class NgramIndex:
    """`ngram_draft` for one sequence whose tokens only grow, kept up to date step by step: the
    first end of every n-gram (min_n <= n <= max_n) that some token follows. A step adds the
    n-grams ending at the positions its accepted tokens made followed (about 2-5 tokens x the n
    range) and looks up at most max_n - min_n + 1 suffixes, where `ngram_draft` scans the whole
    sequence (0.1 ms at 300 tokens of code, on every verify step). Memory: up to
    (max_n - min_n + 1) entries per token, an n-tuple key each."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._first: dict[tuple[int, ...], int] = {}  # n-gram -> its first end e, e + 1 < length
        self._indexed = 0  # the n-grams ending before this position are in `_first`

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        """`ngram_draft(token_ids, k, min_n, max_n)`; `token_ids` extends the list of the last call."""
        length = len(token_ids)
        if length - 1 < self._indexed:
            raise ValueError(f"token_ids: {length} tokens, fewer than the {self._indexed + 1} already indexed")
        first, min_n, max_n = self._first, self.min_n, self.max_n
        for end in range(self._indexed, length - 1):  # the ends a token now follows
            for n in range(min_n, min(max_n, end + 1) + 1):
                first.setdefault(tuple(token_ids[end - n + 1: end + 1]), end)
        self._indexed = max(self._indexed, length - 1)
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            end = first.get(tuple(token_ids[length - n:]))
            if end is not None:
                return token_ids[end + 1: end + 1 + k]
        return []


def accepted_length(drafts: list[int], sampled: list[int]) -> int:
    """How many leading drafts the verify step accepts: `sampled[j]` is the target's draw at the
    position `drafts[j]` proposes (len(sampled) == len(drafts) + 1); the step emits
    `sampled[: a + 1]`."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a


@dataclasses.dataclass
class SpecStats:
    """Counters of verify steps, as vLLM's spec-decode metrics name them."""

    num_drafts: int = 0  # sequence-steps that verified a draft (vllm:spec_decode_num_drafts)
    num_draft_tokens: int = 0  # tokens drafted (vllm:spec_decode_num_draft_tokens)
    num_accepted_tokens: int = 0  # drafted tokens accepted (vllm:spec_decode_num_accepted_tokens)
    # [k] accepted drafts by position in the draft (vllm:spec_decode_num_accepted_tokens_per_pos)
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits per sequence on average: 1 + accepted drafts per draft
        (vLLM's definition; 0 before any draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        """The counters by name, with the mean acceptance length."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_pos": list(self.accepted_per_pos),
                "spec_mean_acceptance_length": self.mean_acceptance_length}


class Speculator:
    """Decides each decode step's drafts and counts what the verify steps accepted."""

    def __init__(self, config: SpeculativeConfig, max_num_seqs: int, max_num_batched_tokens: int):
        if not config.enabled:
            raise ValueError("speculative.method: None (speculation off) needs no Speculator")
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._ngrams: dict[int, NgramIndex] = {}  # method ngram: each drafting sequence's index, by id

    def may_draft(self, num_seqs: int) -> bool:
        """Whether a step of `num_seqs` decoding sequences may verify drafts (the batch-size rules
        of `drafts`, before any sequence is looked at)."""
        return self._depth(num_seqs) >= 1

    def _depth(self, num_seqs: int) -> int:
        """The most drafts per sequence in a step of `num_seqs` decoding sequences (< 1: none)."""
        config = self.config
        if num_seqs < 1 or (config.disable_by_batch_size is not None and num_seqs >= config.disable_by_batch_size):
            return 0
        return min(config.num_speculative_tokens, self.max_num_seqs // num_seqs - 1,
                   self.max_num_batched_tokens // num_seqs - 1)

    def drafts(self, seqs: list[Sequence]) -> list[list[int]] | None:
        """Each decoding sequence's drafts for the next step ([] for one that drafts nothing;
        `room` PLACEHOLDERs each with a draft model, whose drafts the executor computes), or
        None when the step should run without speculation: at or above `disable_by_batch_size`
        sequences, where k + 1 rows per sequence would pass the sampler's rows (max_num_seqs) or
        the token budget, or when no sequence has a draft."""
        config, k = self.config, self._depth(len(seqs))
        if k < 1:
            return None
        drafts = []
        for seq in seqs:
            group = seq.group
            # Each accepted draft and the step's own token must fit max_tokens (and so max_model_len).
            room = min(k, group.max_total_len - len(seq.token_ids) - 1)
            if room < 1 or group.has_controls or seq.constraint is not None:
                drafts.append([])
                continue
            if config.method == "draft_model":  # the executor's draft model fills them in
                drafts.append([PLACEHOLDER] * room)
            else:
                index = self._ngrams.get(seq.seq_id)
                if index is None:
                    index = self._ngrams[seq.seq_id] = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
                drafts.append(index.draft(seq.token_ids, room))
        if len(self._ngrams) > len(seqs):  # indexes of sequences that left the batch (rebuilt if they return)
            current = {seq.seq_id for seq in seqs}
            self._ngrams = {i: index for i, index in self._ngrams.items() if i in current}
        return drafts if any(drafts) else None

    def verified(self, drafts: list[int], sampled: list[int]) -> int:
        """The accepted count of one sequence's drafts (`accepted_length`), counted in `stats`."""
        a = accepted_length(drafts, sampled)
        if drafts:
            stats = self.stats
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += a
            for j in range(a):
                stats.accepted_per_pos[j] += 1
        return a
