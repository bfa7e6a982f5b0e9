"""Profiled step costs (the Vidur approach): time a real executor on a grid of batch shapes, fit
a linear model of step time, and simulate with the fit instead of the roofline.

Decode: t = a + b * batch + c * context_tokens (weights read once; per-sequence work; KV read).
Prefill: t = a + b * tokens + c * attention_pairs + d * context_tokens (GEMMs; causal attention;
KV read and write). Coefficients are fitted by non-negative least squares so that extrapolation
past the grid never predicts a faster step for more work. Swap and copy are not profiled: they
come from the roofline model passed in.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import numpy as np
from scipy.optimize import nnls

from jpaged.sim.cost_model import CostModel
from jpaged.step_plan import StepPlan, bucket


@dataclasses.dataclass(frozen=True)
class ProfileSample:
    """One timed shape: per-sequence query and context lengths and the measured seconds."""

    is_prefill: bool
    query_lens: tuple[int, ...]  # tokens computed per sequence (1 each in decode)
    context_lens: tuple[int, ...]  # context per sequence after the step's writes
    seconds: float  # measured step time (the fastest of the repeats)


def _decode_features(num_seqs: int, context_tokens: float) -> list[float]:
    return [1.0, num_seqs, context_tokens]


def _prefill_features(query_lens: np.ndarray, context_lens: np.ndarray) -> list[float]:
    q = query_lens.astype(np.float64)
    pairs = float((q * (context_lens - q) + 0.5 * q * (q + 1)).sum())
    return [1.0, float(q.sum()), pairs, float(context_lens.sum())]


def synthetic_plan(is_prefill: bool, query_lens: list[int], context_lens: list[int], *,
                   block_size: int, num_blocks: int, vocab_size: int) -> StepPlan:
    """A well-formed StepPlan of the given shape, padded like the scheduler pads, for timing.

    Sequences get consecutive blocks from 1 upward, wrapping within the pool, so sequences may
    share blocks when the pool is small: harmless, the contents are never read back.
    """
    n = len(query_lens)
    q, ctx = np.asarray(query_lens, np.int32), np.asarray(context_lens, np.int32)
    if n == 0 or (q < 1).any() or (q > ctx).any() or (not is_prefill and (q != 1).any()):
        raise ValueError("query_lens must be >= 1 and <= context_lens (1 each for decode), non-empty")
    total = int(q.sum())
    size_s, size_t = bucket(n), (bucket(total, minimum=16) if is_prefill else bucket(n))
    blocks = -(-ctx // block_size)
    tables = np.zeros((size_s, bucket(int(blocks.max()))), np.int32)
    starts = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    for i in range(n):
        tables[i, : blocks[i]] = 1 + (starts[i] + np.arange(blocks[i])) % (num_blocks - 1)
    qsl = np.full(size_s + 1, total, np.int32)
    qsl[: n + 1] = np.concatenate([[0], np.cumsum(q)])
    positions = np.zeros(size_t, np.int32)
    slots = np.zeros(size_t, np.int32)
    for i in range(n):
        pos = np.arange(ctx[i] - q[i], ctx[i])
        positions[qsl[i]: qsl[i + 1]] = pos
        slots[qsl[i]: qsl[i + 1]] = tables[i, pos // block_size] * block_size + pos % block_size
    token_ids = np.zeros(size_t, np.int32)
    token_ids[:total] = np.arange(total) % (vocab_size - 4) + 4
    context = np.zeros(size_s, np.int32)
    context[:n] = ctx
    logits_indices = np.zeros(size_s, np.int32)
    logits_indices[:n] = qsl[1: n + 1] - 1
    return StepPlan(is_prefill, n, total, token_ids, positions, slots, qsl, context, tables, logits_indices)


def profile(execute: Callable[[StepPlan], float], *, block_size: int, num_blocks: int, vocab_size: int,
            decode_batches: tuple[int, ...] = (1, 4, 16, 64), decode_contexts: tuple[int, ...] = (64, 256, 1024),
            prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024), repeats: int = 3) -> list[ProfileSample]:
    """Times `execute(plan) -> seconds` on a grid of shapes; one untimed run per shape compiles it.

    Decode: every (batch, context) pair. Prefill: one prompt of each length, and batches of
    four prompts of a quarter of each length (so the fit separates tokens from attention pairs).
    """
    shapes = [(False, [1] * b, [c] * b) for b, c in itertools.product(decode_batches, decode_contexts)]
    for t in prefill_tokens:
        shapes.append((True, [t], [t]))
        if t >= 4:
            shapes.append((True, [t // 4] * 4, [t // 4] * 4))
    samples = []
    for is_prefill, q, ctx in shapes:
        plan = synthetic_plan(is_prefill, q, ctx, block_size=block_size, num_blocks=num_blocks,
                              vocab_size=vocab_size)
        execute(plan)
        best = min(execute(plan) for _ in range(repeats))
        samples.append(ProfileSample(is_prefill, tuple(q), tuple(ctx), best))
    return samples


class FittedCostModel:
    """Step times from a fit to profiled samples; swap and copy times from a roofline `CostModel`."""

    def __init__(self, samples: list[ProfileSample], transfers: CostModel) -> None:
        decode = [s for s in samples if not s.is_prefill]
        prefill = [s for s in samples if s.is_prefill]
        if len(decode) < 3 or len(prefill) < 4:
            raise ValueError(f"samples must hold >= 3 decode and >= 4 prefill shapes, got "
                             f"{len(decode)} and {len(prefill)}")
        x = np.array([_decode_features(len(s.context_lens), sum(s.context_lens)) for s in decode])
        self.decode_coef = nnls(x, np.array([s.seconds for s in decode]))[0]  # [s, s/seq, s/token]
        x = np.array([_prefill_features(np.array(s.query_lens), np.array(s.context_lens)) for s in prefill])
        self.prefill_coef = nnls(x, np.array([s.seconds for s in prefill]))[0]  # [s, s/token, s/pair, s/ctx token]
        self._transfers = transfers

    def decode_time(self, context_lens: np.ndarray) -> float:
        """Fitted seconds of a decode step over sequences with `context_lens` (i32[B])."""
        if len(context_lens) == 0:
            return 0.0
        a, b, c = self.decode_coef
        return float(a + b * len(context_lens) + c * int(context_lens.sum()))

    def prefill_time(self, query_lens: np.ndarray, context_lens: np.ndarray) -> float:
        """Fitted seconds of a prefill step (same arguments as `CostModel.prefill_time`)."""
        if len(query_lens) == 0:
            return 0.0
        return float(np.dot(self.prefill_coef, _prefill_features(query_lens, context_lens)))

    def swap_time(self, num_blocks: int) -> float:
        """Roofline PCIe time of `num_blocks` blocks (not profiled)."""
        return self._transfers.swap_time(num_blocks)

    def copy_time(self, num_blocks: int) -> float:
        """Roofline device-copy time of `num_blocks` blocks (not profiled)."""
        return self._transfers.copy_time(num_blocks)
