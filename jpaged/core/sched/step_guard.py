"""Finding the request that broke a step, so that it fails alone (the slow path, after a failure).

Requests are checked at the door (`LLMEngine.add_request`), so a step should never fail because
of one of them. If one still does (its sampling settings changed after the door, say), the
engine asks which requests' own part of the step cannot be prepared, ends those with an error and
runs the step again without their sample rows. Nothing here runs on a step that succeeds.
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import dataclasses

from jpaged.core.sequence import SequenceGroup
from jpaged.core.step_plan import SampleRows


def describe(exc: BaseException) -> str:
    """An exception as the error text of a request's output."""
    return f"{type(exc).__name__}: {exc}"


def _rows_of_groups(rows: SampleRows) -> dict[SequenceGroup, list[int]]:
    """The sample rows of each request, in row order."""
    by_group: dict[SequenceGroup, list[int]] = {}
    for r, seq in enumerate(rows.seqs):
        by_group.setdefault(seq.group, []).append(r)
    return by_group


def subset(rows: SampleRows, keep: list[int]) -> SampleRows:
    """The sample rows `keep` of `rows` (a new SampleRows; its batch is built afresh; the batch's
    stop shortcut is not kept, so the rows go through the row-by-row stop checks). A verify step's
    rows are kept or dropped a whole sequence at a time (by sequence or by request)."""
    seqs = [rows.seqs[r] for r in keep]
    groups = {id(s.group) for s in seqs}
    return SampleRows(seqs=seqs, logits_rows=rows.logits_rows[keep],
                      indices=None if rows.indices is None else [rows.indices[r] for r in keep],
                      num_top=rows.num_top, is_plain=rows.is_plain,
                      first_token_groups=[g for g in rows.first_token_groups if id(g) in groups],
                      spec_offsets=None if rows.spec_offsets is None else [rows.spec_offsets[r] for r in keep],
                      spec_drafts=None if rows.spec_drafts is None else [rows.spec_drafts[r] for r in keep])


def failing_groups(rows: SampleRows) -> dict[SequenceGroup, str]:
    """The requests whose own sample rows cannot be prepared, each with the cause.

    Each request is probed alone: its sampling parameters go through the door's checks again
    (a frozen SamplingParams can still be changed with object.__setattr__), then its rows' device
    arrays are built (`SampleRows.batch`, what every executor's sampling reads).
    """
    failures: dict[SequenceGroup, str] = {}
    for group, keep in _rows_of_groups(rows).items():
        try:
            dataclasses.replace(group.sampling_params)  # re-runs SamplingParams.__post_init__
            subset(rows, keep).batch
        except Exception as exc:  # whatever it is, it is this request's alone
            failures[group] = f"request {group.request_id!r} failed in a step: {describe(exc)}"
    return failures


def without_groups(rows: SampleRows, groups) -> SampleRows | None:
    """`rows` without the rows of `groups` (None when no row is left)."""
    keep = [r for r, seq in enumerate(rows.seqs) if seq.group not in groups]
    return subset(rows, keep) if keep else None
