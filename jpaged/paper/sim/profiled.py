"""Profiled step costs (the Vidur approach): a linear model of step time fitted to a real
executor's times on a grid of batch shapes, to simulate with instead of the roofline. The grid is
timed by experiments.bench.profile_executor (`profile`); the fit and its samples live here.

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

import numpy as np
from scipy.optimize import nnls

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
