"""One step of beam search over a group's live beams (host side; paper §4.4 shares their blocks).

Every live beam proposes its `2 * width` most likely next tokens; candidates are ranked by
cumulative log-probability (ties: earlier beam, then more likely token). Walking down the ranking,
a candidate ending in a stop token becomes a finished hypothesis, any other becomes a live beam,
until `width` live beams are chosen. Beams left without children are dropped (their blocks freed);
beams with several children fork (their blocks shared, copy-on-write on the next write).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A proposed extension of beam `parent` by `token`."""

    parent: int  # index of the parent among the live beams
    token: int
    score: float  # parent's cumulative logprob + log p(token)


def select(cumulative: list[float], top_ids: np.ndarray, top_logprobs: np.ndarray, width: int,
           stop_token_ids: frozenset[int]) -> tuple[list[Candidate], list[Candidate]]:
    """Ranks candidates of the live beams; returns (next live beams, finished hypotheses).

    top_ids / top_logprobs: [num_beams, >= 2 * width] best first, one row per live beam.
    """
    candidates = []
    for parent, base in enumerate(cumulative):
        for rank in range(2 * width):
            candidates.append((base + float(top_logprobs[parent, rank]), parent, rank,
                               int(top_ids[parent, rank])))
    candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
    live: list[Candidate] = []
    finished: list[Candidate] = []
    for score, parent, _, token in candidates:
        if len(live) == width:
            break
        target = finished if token in stop_token_ids else live
        target.append(Candidate(parent, token, score))
    return live, finished


def final_score(cumulative_logprob: float, output_len: int, length_penalty: float) -> float:
    """Score of a finished hypothesis: cumulative logprob / output_len ** length_penalty."""
    return cumulative_logprob / max(output_len, 1) ** length_penalty
