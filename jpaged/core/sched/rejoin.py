"""How a recomputed group's sequences rejoin it, sharing the blocks of the history they share.

Preemption by recompute drops a group's blocks; its sequences (n samples, beams) then run their
histories again. The group is admitted through its first sequence; each other sequence waits
here with the longest common prefix of whole blocks it has with an earlier live sequence of its
group (its `Share`), and joins by forking that prefix once the prefix is computed (in an earlier
step, or in the same one by whole-prompt admission), so shared history is computed and stored
once, as before the preemption. Only the rest of each sequence is computed again.

A recomputed group rejoins as a unit: beam search ranks all its beams in one step, so unless
every sequence can be scheduled to its end in a step, each stops one token short of its end
(`short_by`). Pure Python: no jax import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.sequence import Sequence


class Share(NamedTuple):
    """The prefix a joining sequence shares with an earlier sequence of its group."""

    source: Sequence | None  # the earlier sequence (None: it shares no whole block)
    tokens: int  # shared tokens: blocks x block_size
    blocks: int  # shared blocks, forked from the source's row when the sequence joins


class Rejoin:
    """Sequences of recomputed groups waiting to join their group, by seq id."""

    def __init__(self, kv: KVCacheManager):
        self.kv = kv
        self._waiting: dict[int, Share] = {}  # seq id -> what it will share

    def share(self, seq: Sequence) -> Share:
        """The longest common prefix of whole blocks `seq` has with an earlier live sequence of its
        group (never its last token: that one computes the logits it samples from)."""
        bs = self.kv.block_size
        best = Share(None, 0, 0)
        limit = (len(seq.token_ids) - 1) // bs
        for other in seq.group.live_seqs():
            if other is seq:
                break
            common = 0
            for a, b in zip(seq.token_ids, other.token_ids):
                if a != b:
                    break
                common += 1
            blocks = min(common // bs, limit)
            if blocks > best.blocks:
                best = Share(other, blocks * bs, blocks)
        return best

    def wait(self, seq: Sequence, share: Share) -> None:
        """`seq` joins its admitted group later, sharing `share`."""
        self._waiting[seq.seq_id] = share

    def forget(self, seq_id: int) -> None:
        """`seq_id` left its group (finished, aborted or preempted again): it joins no more."""
        self._waiting.pop(seq_id, None)

    def can_attach(self, seq: Sequence) -> bool:
        """Whether a waiting sequence's shared prefix is computed (in an earlier step, or in this
        one by whole-prompt admission); a source that finished since is replaced by a new share."""
        share = self._waiting[seq.seq_id]
        if share.source is not None and share.source.status.is_finished:  # it left the group: share anew
            self._waiting[seq.seq_id] = share = self.share(seq)
        return share.source is None or self.kv.rows.num_slots(share.source.seq_id) >= share.tokens

    def attach(self, seq: Sequence) -> None:
        """Gives a waiting sequence its row, forking its shared prefix (a block event, which
        the KV manager counts)."""
        share = self._waiting.pop(seq.seq_id)
        if share.source is None:
            self.kv.admit(seq.seq_id, final_len=seq.group.max_total_len, num_tokens=len(seq.token_ids))
        else:
            self.kv.fork(share.source.seq_id, seq.seq_id, share.blocks)

    def short_by(self, seqs: list[Sequence], room: int, chunk_limit: int) -> int:
        """1 when a recomputed group's live `seqs` cannot all be scheduled to their end in this step
        (within `room` tokens, `chunk_limit` per sequence, every one able to join): each then
        stops one token short, so that the group samples as a unit; else 0."""
        rows, waiting = self.kv.rows, self._waiting
        # Tokens each has left to compute: past its slots, or (still waiting) past what it shares.
        todo = [len(s.token_ids) - (rows.num_slots(s.seq_id) if rows.has_seq(s.seq_id) else waiting[s.seq_id].tokens)
                for s in seqs]
        whole = (all(rows.has_seq(s.seq_id) or self.can_attach(s) for s in seqs)
                 and sum(todo) <= room and max(todo) <= chunk_limit)
        return 0 if whole else 1
