"""The running set: the running groups, those still prefilling, and the decode batch kept for the rest.

Running groups are kept by arrival (preemption takes the latest). Each counts against
max_num_seqs at its width (n samples or beams), so a fresh group's later forks and a beam step's
churn never push a batch past the limit. Groups with a sequence still prefilling (chunks left)
or not yet holding blocks (a recomputed group's sequences rejoin one by one: `jpaged.core.sched.rejoin`)
are `partial`; the decoding sequences of the others, and their rows, are a `PersistentBatch`, kept
across steps instead of rebuilt.

Events edit the kept batch: groups that joined running or finished their prompts add their
sequences at the next step, finished sequences leave it then (`drop`), a preempted group's at
once (`evict`). A removal moves the last row into the hole, which would reorder a forked group's
rows, and beam ranks follow their order: while a running group has several sequences, a removal
or a fork rebuilds the batch instead, in running order, as a fresh batch would be. The decode
fast path rests on it: when nothing changed since the last step (`steady`), a step is the batch's
decode step alone (the scheduler still checks that admission would stop). Pure Python.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Collection, Iterable

from jpaged.core.sched.persistent_batch import PersistentBatch
from jpaged.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.sequence import Sequence, SequenceGroup


def _arrival(group: SequenceGroup) -> int:
    return group.arrival_order


class RunningSet:
    """Running groups by arrival, the partial ones among them, and the kept decode batch."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self.groups: list[SequenceGroup] = []  # the running groups, sorted by arrival_order
        self.partial: list[SequenceGroup] = []  # those still prefilling or joining, by arrival_order
        self.num_seqs = 0  # the groups' widths: what they count against max_num_seqs
        self.num_multi = 0  # groups that hold or will hold several sequences (n > 1, beams)
        self._batch: PersistentBatch | None = None  # None: rebuilt at the next step
        self._joins: list[SequenceGroup] = []  # groups whose running sequences join at the next step
        self._drops: list[Sequence] = []  # sequences that leave at the next step

    # ------------------------------------------------------------------ the running set

    def join(self, group: SequenceGroup) -> None:
        """A group starts running (admitted or swapped in); its sequences decode from the next
        step on unless it is partial by then."""
        groups = self.groups
        if not groups or groups[-1].arrival_order < group.arrival_order:
            groups.append(group)  # the usual case: the latest arrival so far
        else:
            bisect.insort(groups, group, key=_arrival)
        self.num_seqs += group.width
        self.num_multi += not group.is_single
        self._joins.append(group)

    def leave(self, group: SequenceGroup) -> None:
        """A group stops running (finished or aborted; its sequences leave by `drop`)."""
        if self.groups[-1] is group:  # (preemption takes the latest arrival)
            self.groups.pop()
        else:
            self.groups.remove(group)
        if group in self.partial:
            self.partial.remove(group)
        self.num_seqs -= group.width
        self.num_multi -= not group.is_single

    def evict(self, group: SequenceGroup) -> None:
        """A preempted group stops running; its sequences leave the batch now (a rebuild while
        another running group has several sequences)."""
        self.leave(group)
        if self.num_multi:
            self._batch = None
        elif self._batch is not None:
            self._batch.discard(group.seqs)

    def mark_partial(self, group: SequenceGroup) -> None:
        """A running group has prompt chunks (or joining sequences) left."""
        bisect.insort(self.partial, group, key=_arrival)

    def prefilled(self, group: SequenceGroup) -> None:
        """A partial group's every sequence is scheduled to its end: it decodes from the next step."""
        self.partial.remove(group)
        self._joins.append(group)

    def drop(self, seqs: Iterable[Sequence]) -> None:
        """Sequences that finished (or were aborted) leave the batch at the next step."""
        self._drops += seqs

    def rebuild(self) -> None:
        """The batch is rebuilt at the next step: a running sequence forked (rows keep group
        order)."""
        self._batch = None

    # ------------------------------------------------------------------ the decode batch

    def steady(self, swapped: Collection[SequenceGroup]) -> PersistentBatch | None:
        """The batch when the decode fast path may run it: no event since the last step, nothing
        partial, nothing `swapped` (the swapped queue) and no group with several sequences (else None)."""
        batch = self._batch
        if batch is None or self._joins or self._drops or self.partial or swapped or self.num_multi:
            return None
        return batch

    def current(self) -> PersistentBatch:
        """The decoding sequences of the running groups (partial ones excluded) and their rows:
        the kept batch brought up to date with the events since the last step, or a fresh one."""
        batch = self._batch
        if batch is None:
            if not self.partial and self.num_multi == 0:  # one running sequence per group
                seqs = [g.seqs[0] for g in self.groups]
            else:
                running, skip = SequenceStatus.RUNNING, {id(g) for g in self.partial}
                seqs = [s for g in self.groups if id(g) not in skip for s in g.seqs if s.status is running]
            self._batch = batch = PersistentBatch(self.kv, seqs)
            self._joins.clear()
            self._drops.clear()
            return batch
        if self._drops:
            if self.num_multi:
                self._batch = None
                return self.current()
            batch.discard(self._drops)
            self._drops.clear()
        if self._joins:
            # (A group that left running since has no running sequence: preempted or ended.)
            running = SequenceStatus.RUNNING
            for group in self._joins:
                if group.is_single:
                    if group.seqs[0].status is running and group not in self.partial:
                        batch.add(group.seqs)
                elif group not in self.partial:
                    batch.add([s for s in group.seqs if s.status is running])
            self._joins.clear()
        return batch
