"""The host half of the sampling controls: one step's per-row arrays for the sampler on device.

vLLM's logits processors and penalties (SamplingParams: penalties, logit_bias, min_tokens,
allowed_token_ids, bad words, a structured-output constraint) need a few facts per sample row.
They travel as compact arrays, never [R, vocab] ones: the tokens a penalty counts, sparse
(id, bias) pairs, the ids banned this step, and a bitmask only for the rows restricted to a set of
tokens. Lists are padded to a power of two (PAD_ID after each row's entries) so that the sampler
compiles few shapes. A row's arrays depend only on its own sequence: never on the batch.
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.constraints import bitmask_words, set_bits

if TYPE_CHECKING:
    from jpaged.core.sequence import SamplingParams, Sequence

PAD_ID = np.iinfo(np.int32).max  # pads the id lists: outside every vocabulary, dropped on device


@dataclasses.dataclass
class SamplingControls:
    """The controls of R sample rows; a field is None when no row of the step uses it."""

    penalties: np.ndarray | None = None  # f32[R, 3] presence, frequency, repetition penalty (neutral 0, 0, 1)
    history: np.ndarray | None = None  # i32[R, L] tokens the penalties see (prompt if repetition, then output), PAD_ID after
    output_start: np.ndarray | None = None  # i32[R] index of each row's first output token in `history`
    bias_ids: np.ndarray | None = None  # i32[R, B] logit_bias token ids, PAD_ID after
    bias_values: np.ndarray | None = None  # f32[R, B] the bias of each
    banned: np.ndarray | None = None  # i32[R, N] ids that may not be sampled now (min_tokens, bad words), PAD_ID after
    allowed_rows: np.ndarray | None = None  # i32[A] the rows restricted to a set of tokens
    allowed_masks: np.ndarray | None = None  # i32[A, W] their sets: token t is bit t % 32 of word t // 32


def list_width(n: int, minimum: int = 8) -> int:
    """The padded width of a list of n entries: a power of two, at least `minimum`."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def history_width(max_model_len: int) -> int:
    """The widest penalty history a row can have under `max_model_len` (prompt and output), as
    `build_controls` pads it: the sampler's fixed history width."""
    return list_width(max_model_len, 64)


def _padded(rows: list[np.ndarray | list], dtype, fill, width: int) -> np.ndarray:
    """[len(rows), width] with row i's entries first, `fill` after."""
    out = np.full((len(rows), width), fill, dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


class TokenHistory:
    """A sequence's tokens as a growing int32 array, brought up to date from its token list on use
    (tokens only ever append while penalties apply: beam search refuses them)."""

    __slots__ = ("ids", "size")

    def __init__(self) -> None:
        self.ids = np.zeros(0, np.int32)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """i32[len(token_ids)] the tokens, copying only those appended since the last call."""
        n = len(token_ids)
        if n > len(self.ids):
            grown = np.zeros(max(n, 2 * len(self.ids), 64), np.int32)
            grown[: self.size] = self.ids[: self.size]
            self.ids = grown
        if n != self.size:
            self.ids[self.size: n] = token_ids[self.size: n]
            self.size = n
        return self.ids[:n]


def _history(seq: Sequence, params: SamplingParams) -> tuple[np.ndarray, int]:
    """The tokens the row's penalties count and where its output starts among them: the repetition
    penalty sees the prompt too, presence and frequency only the output."""
    if seq.history is None:
        seq.history = TokenHistory()
    tokens = seq.history.sync(seq.token_ids)
    if params.repetition_penalty != 1.0:
        return tokens, seq.prompt_len
    return tokens[seq.prompt_len:], 0


def _banned(seq: Sequence, params: SamplingParams) -> list[int]:
    """Ids the row may not sample now: min_tokens' stop ids while the output is short, and the last
    token of every bad word whose other tokens end the output (vLLM's rule, over output tokens)."""
    banned = list(seq.group.min_tokens_banned) if seq.num_output_tokens < params.min_tokens else []
    if params.bad_words_token_ids:
        output = seq.token_ids[seq.prompt_len:]
        for word in params.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix <= len(output) and (prefix == 0 or output[-prefix:] == list(word[:-1])):
                banned.append(word[-1])
    return banned


def _allowed(seq: Sequence, params: SamplingParams) -> np.ndarray | None:
    """i32[words] the tokens the row may sample (allowed_token_ids and its constraint, both if
    both), or None when unrestricted."""
    masks = []
    if params.allowed_token_ids is not None:
        ids = np.asarray(params.allowed_token_ids, np.int32)
        mask = np.zeros(bitmask_words(int(ids.max()) + 1), np.int32)
        set_bits(mask, ids)
        masks.append(mask)
    if seq.constraint is not None:
        mask = np.zeros(bitmask_words(seq.constraint.vocab_size), np.int32)
        seq.constraint.allowed(mask)
        masks.append(mask)
    if not masks:
        return None
    if len(masks) == 1:
        return masks[0]
    width = min(len(m) for m in masks)  # tokens beyond the shorter mask are not allowed by it
    return masks[0][:width] & masks[1][:width]


def build_controls(seqs: list[Sequence]) -> SamplingControls | None:
    """The controls of sample rows `seqs` (row r extends `seqs[r]`), None when no row has any."""
    rows = [(r, seq, seq.group.sampling_params) for r, seq in enumerate(seqs) if seq.group.has_controls]
    if not rows:
        return None
    num_rows = len(seqs)
    out = SamplingControls()
    penalized = [(r, seq, p) for r, seq, p in rows
                 if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0]
    if penalized:
        out.penalties = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (num_rows, 1))
        histories: list[np.ndarray] = [np.zeros(0, np.int32)] * num_rows
        out.output_start = np.zeros(num_rows, np.int32)
        for r, seq, p in penalized:
            out.penalties[r] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            histories[r], out.output_start[r] = _history(seq, p)
        out.history = _padded(histories, np.int32, PAD_ID, list_width(max(map(len, histories)), 64))
    biased = [(r, p.logit_bias) for r, _, p in rows if p.logit_bias]
    if biased:
        ids: list[list[int]] = [[] for _ in range(num_rows)]
        values: list[list[float]] = [[] for _ in range(num_rows)]
        for r, bias in biased:
            ids[r], values[r] = list(bias), list(bias.values())
        width = list_width(max(map(len, ids)))
        out.bias_ids, out.bias_values = _padded(ids, np.int32, PAD_ID, width), _padded(values, np.float32, 0.0, width)
    banned = [[] for _ in range(num_rows)]
    for r, seq, p in rows:
        banned[r] = _banned(seq, p)
    if any(banned):
        out.banned = _padded(banned, np.int32, PAD_ID, list_width(max(map(len, banned))))
    masks, mask_rows, seen = [], [], {}
    for r, seq, p in rows:
        if id(seq) not in seen:  # a fresh prompt's n rows share one sequence: ask its constraint once
            seen[id(seq)] = _allowed(seq, p)
        if seen[id(seq)] is not None:
            mask_rows.append(r)
            masks.append(seen[id(seq)])
    if masks:
        out.allowed_rows = np.array(mask_rows, np.int32)
        # (the sampler widens them to the vocabulary's words: tokens past a mask are not allowed)
        out.allowed_masks = _padded(masks, np.int32, 0, max(map(len, masks)))
    return out
