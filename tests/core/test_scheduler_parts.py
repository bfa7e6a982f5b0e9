"""The scheduler's parts by hand: the running set and its persistent batch (running_set), a recomputed
group's shares (rejoin), and the held-back memo of admission (admission)."""

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.rejoin import Rejoin, Share
from jpaged.core.sched.running_set import RunningSet
from jpaged.core.sched.scheduler import Scheduler
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup, SequenceStatus
from tests.helpers.kv import allocate

BS = 4


def group(order: int, tokens: list[list[int]], n: int = 1) -> SequenceGroup:
    """A group of `order`-th arrival whose sequences hold `tokens` (ids order * 10 + i), running."""
    seqs = [Sequence(order * 10 + i, list(t)) for i, t in enumerate(tokens)]
    g = SequenceGroup(str(order), seqs, SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, max_tokens=50),
                      0.0, order)
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    return g


def resident(bm: BlockManager, g: SequenceGroup) -> SequenceGroup:
    """Rows for each of `g`'s sequences holding all but its last token (it decodes that one next)."""
    for seq in g.seqs:
        allocate(bm, seq.seq_id, len(seq) - 1)
    return g


def test_running_set_keeps_arrival_order_widths_and_the_fast_path():
    bm = BlockManager(64, BS, 0, 64, watermark=0.0, max_seqs=8)
    running = RunningSet(bm)
    late, early = resident(bm, group(2, [[1] * 5])), resident(bm, group(1, [[2] * 6]))
    running.join(late)
    running.join(early)  # arrived earlier: goes first
    assert running.groups == [early, late] and running.num_seqs == 2 and running.num_multi == 0
    assert running.steady(swapped=()) is None  # nothing kept yet
    batch = running.current()
    assert batch.seqs == [early.seqs[0], late.seqs[0]]
    assert running.steady(swapped=()) is batch and running.steady(swapped=[late]) is None
    running.drop(late.seqs)  # a finish: the batch drops it at the next step ...
    assert running.steady(swapped=()) is None
    running.leave(late)
    assert running.current() is batch and batch.seqs == [early.seqs[0]]  # ... edited, not rebuilt
    running.mark_partial(late)  # (a partial group's sequences stay out of the batch)
    running.join(late)
    assert running.current().seqs == [early.seqs[0]] and running.partial == [late]
    running.prefilled(late)
    assert running.current().seqs == [early.seqs[0], late.seqs[0]] and not running.partial


def test_with_a_forked_group_running_a_removal_rebuilds_in_running_order():
    bm = BlockManager(64, BS, 0, 64, watermark=0.0, max_seqs=8)
    running = RunningSet(bm)
    single = resident(bm, group(1, [[1] * 5]))
    beams = resident(bm, group(2, [[2] * 5, [3] * 5, [4] * 5], n=3))
    for g in (single, beams):
        running.join(g)
    batch = running.current()
    assert running.num_multi == 1 and batch.seqs == [single.seqs[0]] + beams.seqs
    beams.seqs[0].status = SequenceStatus.FINISHED_STOPPED
    running.drop(beams.seqs[:1])
    rebuilt = running.current()
    # Moving the last row into the hole would give [single, beam 2, beam 1]: the beams keep their order.
    assert rebuilt is not batch and rebuilt.seqs == [single.seqs[0], beams.seqs[1], beams.seqs[2]]
    running.evict(beams)  # preempting the forked group: no group with several sequences is left ...
    assert running.groups == [single] and running.num_multi == 0 and running.num_seqs == 1
    assert running.current().seqs == [single.seqs[0]]  # (... after a rebuild, edits again)


def test_rejoin_shares_the_longest_whole_block_prefix_but_never_the_last_token():
    bm = BlockManager(64, BS, 0, 64, watermark=0.0, max_seqs=8)
    rejoin = Rejoin(bm)
    g = group(1, [list(range(10)), list(range(9)) + [99], list(range(6)) + [98] * 4, list(range(8))], n=4)
    first, second, third, fourth = g.seqs
    assert rejoin.share(first) == Share(None, 0, 0)  # the first sequence shares with nobody earlier
    assert rejoin.share(second) == Share(first, 8, 2)  # 9 common tokens: 2 whole blocks
    assert rejoin.share(third) == Share(first, 4, 1)
    assert rejoin.share(fourth) == Share(first, 4, 1)  # 8 common, but its last token is never shared
    allocate(bm, first.seq_id, 4)  # the first block of the first sequence is computed
    rejoin.wait(second, rejoin.share(second))
    rejoin.wait(third, rejoin.share(third))
    assert not rejoin.can_attach(second) and rejoin.can_attach(third)
    # The group cannot finish now (the second waits for its prefix): every sequence stops one short.
    assert rejoin.short_by([first, second, third], room=100, chunk_limit=100) == 1
    rejoin.attach(third)
    assert bm.rows.table(third.seq_id).tolist() == bm.rows.table(first.seq_id).tolist()[:1]
    first.status = SequenceStatus.FINISHED_STOPPED  # its source left the group: it shares anew
    assert rejoin.can_attach(second)


def test_admission_memo_skips_retries_until_something_changes():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                          policy="chunked"),
                          CacheConfig(block_size=BS, num_blocks=6, num_host_blocks=0, watermark=0.0))
    admission = scheduler.admission
    big = SequenceGroup("big", [Sequence(1, list(range(18)))], SamplingParams(max_tokens=20), 0.0, 0)
    scheduler.add(big)
    out = scheduler.schedule()  # 18 tokens in 5 blocks (the whole pool): admitted, its prompt chunked in
    assert out.admitted == [big] and not out.kv_full
    small = SequenceGroup("small", [Sequence(2, list(range(8)))], SamplingParams(max_tokens=4), 0.0, 1)
    scheduler.add(small)
    out = scheduler.schedule()
    assert out.admitted == [] and out.kv_full and admission.held_back.group is small
    held = admission.held_back
    assert admission.blocked(True, 64) is True  # held back, nothing changed: the next step skips it
    admission.held_back = held._replace(kv_events=held.kv_events - 1)  # a block event since: the next step tries again
    assert admission.blocked(True, 64) is None
    admission.held_back = held
    assert admission.blocked(True, held.remaining - 1) is None  # (chunked) it would ask for fewer tokens
    assert admission.blocked(False, 64) is False  # admission closed (request-level batching)
