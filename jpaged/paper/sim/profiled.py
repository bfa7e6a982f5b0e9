"""Profiled step costs (the Vidur approach): time a real executor on a grid of batch shapes, fit
a linear model of step time, and simulate with the fit instead of the roofline.

One model times any batch mix. Rows with query 1 are decode rows, the others prefill (or chunked
prefill) rows; a step pays one fixed cost, that of a decode-only step or, when any row prefills,
that of a prefill step (a different compiled program), plus per-row work:
    t = a_decode [no prefill row] + a_prefill [some prefill row]
        + b * decode_rows + c * decode_context_tokens           (per-sequence work; KV read)
        + d * prefill_tokens + e * attention_pairs + f * prefill_context_tokens
                                                                (GEMMs; causal attention; KV read)
Coefficients are fitted by non-negative least squares so that extrapolation past the grid never
predicts a faster step for more work. Swap and copy are not profiled: they come from the roofline
model passed in.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import numpy as np
from scipy.optimize import nnls

from jpaged.core.step_plan import StepPlan
from jpaged.paper.sim.cost_model import CostModel


@dataclasses.dataclass(frozen=True)
class ProfileSample:
    """One timed shape: per-sequence query and context lengths and the measured seconds."""

    query_lens: tuple[int, ...]  # tokens computed per sequence (1 for a decode row)
    context_lens: tuple[int, ...]  # context per sequence after the step's writes
    seconds: float  # measured step time (the fastest of the repeats)


def step_features(query_lens: np.ndarray, context_lens: np.ndarray) -> np.ndarray:
    """f64[7] features of one step (the module docstring's model, in its order)."""
    decode = query_lens == 1
    q = query_lens[~decode].astype(np.float64)
    ctx = context_lens[~decode]
    has_prefill = float(len(q) > 0)
    return np.array([1.0 - has_prefill, has_prefill, float(decode.sum()), float(context_lens[decode].sum()),
                     float(q.sum()), float((q * (ctx - q) + 0.5 * q * (q + 1)).sum()), float(ctx.sum())])


def synthetic_plan(query_lens: list[int], context_lens: list[int], *,
                   block_size: int, num_blocks: int, vocab_size: int) -> StepPlan:
    """A well-formed StepPlan of the given shape, padded like the scheduler pads, for timing.

    Sequences get consecutive blocks from 1 upward, wrapping within the pool, so sequences may
    share blocks when the pool is small: harmless, the contents are never read back. The query
    tokens are ids 4, 5, ... (wrapping below `vocab_size`); the context before them is never read.
    """
    if not query_lens or len(query_lens) != len(context_lens) or not all(
            1 <= q <= c for q, c in zip(query_lens, context_lens)):
        raise ValueError("query_lens must be non-empty, each >= 1 and <= its context_lens")
    blocks = [-(-c // block_size) for c in context_lens]
    starts = np.cumsum([0] + blocks[:-1])
    tables = [(1 + (start + np.arange(b)) % (num_blocks - 1)).tolist() for start, b in zip(starts, blocks)]
    ids = (np.arange(sum(query_lens)) % (vocab_size - 4) + 4).tolist()
    ends = np.cumsum(query_lens).tolist()
    contexts = [[0] * (c - q) + ids[end - q: end] for q, c, end in zip(query_lens, context_lens, ends)]
    return StepPlan.from_contexts(contexts, query_lens, tables, block_size)


def profile(execute: Callable[[StepPlan], float], *, block_size: int, num_blocks: int, vocab_size: int,
            decode_batches: tuple[int, ...] = (1, 4, 16, 64), decode_contexts: tuple[int, ...] = (64, 256, 1024),
            prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024), repeats: int = 3) -> list[ProfileSample]:
    """Times `execute(plan) -> seconds` on a grid of shapes; one untimed run per shape compiles it.

    Decode: every (batch, context) pair. Prefill: one prompt of each length, and batches of four
    prompts of a quarter of each length (so the fit separates tokens from attention pairs). Mixed:
    one prompt of each length beside four decode rows of the middle decode context.
    """
    shapes = [([1] * b, [c] * b) for b, c in itertools.product(decode_batches, decode_contexts)]
    mid_context = decode_contexts[len(decode_contexts) // 2]
    for t in prefill_tokens:
        shapes.append(([t], [t]))
        if t >= 8:
            shapes.append(([t // 4] * 4, [t // 4] * 4))
        shapes.append(([t] + [1] * 4, [t] + [mid_context] * 4))
    samples = []
    for q, ctx in shapes:
        plan = synthetic_plan(q, ctx, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
        execute(plan)
        best = min(execute(plan) for _ in range(repeats))
        samples.append(ProfileSample(tuple(q), tuple(ctx), best))
    return samples


class FittedCostModel:
    """Step times from a fit to profiled samples; swap and copy times from a roofline `CostModel`."""

    def __init__(self, samples: list[ProfileSample], transfers: CostModel) -> None:
        x = np.array([step_features(np.array(s.query_lens), np.array(s.context_lens)) for s in samples])
        num_decode, num_prefill = int(x[:, 0].sum()), int(x[:, 1].sum())
        if num_decode < 3 or num_prefill < 4:
            raise ValueError(f"samples must hold >= 3 decode-only and >= 4 prefill shapes, got "
                             f"{num_decode} and {num_prefill}")
        # [s decode step, s prefill step, s/decode row, s/decode ctx token, s/prefill token, s/pair, s/prefill ctx token]
        self.coef = nnls(x, np.array([s.seconds for s in samples]))[0]
        self._transfers = transfers

    def step_time(self, query_lens: np.ndarray, context_lens: np.ndarray) -> float:
        """Fitted seconds of a step of any mix (same arguments as `CostModel.step_time`)."""
        if len(query_lens) == 0:
            return 0.0
        return float(self.coef @ step_features(query_lens, context_lens))

    def decode_time(self, context_lens: np.ndarray) -> float:
        """Fitted seconds of a decode step over sequences with `context_lens` (i32[B])."""
        return self.step_time(np.ones(len(context_lens), np.int32), context_lens)

    def prefill_time(self, query_lens: np.ndarray, context_lens: np.ndarray) -> float:
        """The same as `step_time` (kept for callers that split decode and prefill)."""
        return self.step_time(query_lens, context_lens)

    def swap_time(self, num_blocks: int) -> float:
        """Roofline PCIe time of `num_blocks` blocks (not profiled)."""
        return self._transfers.swap_time(num_blocks)

    def copy_time(self, num_blocks: int) -> float:
        """Roofline device-copy time of `num_blocks` blocks (not profiled)."""
        return self._transfers.copy_time(num_blocks)
