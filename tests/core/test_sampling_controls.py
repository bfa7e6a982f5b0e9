"""jpaged.core.sampling_controls: the host's per-row arrays for the sampler's controls (no jax)."""

import numpy as np
import pytest

from jpaged.core.constraints import bitmask_words, set_bits
from jpaged.core.sampling_controls import PAD_ID, TokenHistory, build_controls
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from tests.helpers.constraints import DigitsThenEos

EOS = 2


def seq_of(prompt, outputs, eos=(EOS,), **params):
    """A sequence of a fresh one-sequence request holding `outputs` after `prompt`."""
    seq = Sequence(0, list(prompt))
    SequenceGroup("r", [seq], SamplingParams(**params), 0.0, 0, eos_token_ids=eos)
    seq.token_ids += outputs
    return seq


def row(array, r):
    """Row r of a padded id array without its padding."""
    return [int(t) for t in array[r] if t != PAD_ID]


def test_plain_rows_have_no_controls():
    assert build_controls([seq_of([1, 2], [3]), seq_of([4], [], temperature=1.0, min_p=0.2)]) is None


def test_penalties_see_the_prompt_only_for_repetition():
    rep = seq_of([5, 6, 5], [7, 7], repetition_penalty=1.3)
    freq = seq_of([5, 6], [8, 9, 8], frequency_penalty=0.5, presence_penalty=-0.25)
    plain = seq_of([1], [1])
    c = build_controls([rep, plain, freq])
    np.testing.assert_array_equal(c.penalties, np.float32([[0, 0, 1.3], [0, 0, 1], [-0.25, 0.5, 1]]))
    assert row(c.history, 0) == [5, 6, 5, 7, 7] and c.output_start[0] == 3
    assert row(c.history, 1) == [] and row(c.history, 2) == [8, 9, 8] and c.output_start[2] == 0
    assert c.history.shape == (3, 64)  # a power of two, at least 64
    assert c.bias_ids is None and c.banned is None and c.allowed_rows is None


def test_token_history_copies_only_what_was_appended():
    history, tokens = TokenHistory(), [1, 2, 3]
    np.testing.assert_array_equal(history.sync(tokens), [1, 2, 3])
    kept = history.ids
    tokens += list(range(10, 40))
    np.testing.assert_array_equal(history.sync(tokens), [1, 2, 3] + list(range(10, 40)))
    assert history.ids is kept  # room for 64 from the start: appended in place
    tokens += list(range(100))
    np.testing.assert_array_equal(history.sync(tokens), tokens)


def test_min_tokens_bans_every_stop_id_and_eos_until_reached():
    short = seq_of([1], [9, 9], min_tokens=3, stop_token_ids=[7], ignore_eos=True)
    long = seq_of([1], [9, 9, 9], min_tokens=3, stop_token_ids=[7])
    c = build_controls([short, long])
    assert row(c.banned, 0) == [EOS, 7]  # vLLM's all_stop_token_ids: EOS even under ignore_eos
    assert row(c.banned, 1) == []


@pytest.mark.parametrize("outputs, banned", [
    ([], [30]),  # one-token word: always; [4, 5] needs a 4 before; [6, 7, 8] needs 6, 7
    ([4], [30, 5]),
    ([6, 7], [30, 8]),
    ([7, 6, 7], [30, 8]),
    ([6, 7, 1], [30]),
])
def test_bad_words_ban_the_last_token_when_the_output_ends_with_the_rest(outputs, banned):
    seq = seq_of([6, 7], outputs, bad_words_token_ids=[[30], [4, 5], [6, 7, 8]])
    assert row(build_controls([seq]).banned, 0) == banned  # (the prompt's 6, 7 never count)


def test_logit_bias_pairs_and_allowed_masks():
    biased = seq_of([1], [], logit_bias={3: 2.5, 40: -100.0})
    allowed = seq_of([1], [], allowed_token_ids=[0, 33, 70])
    c = build_controls([biased, allowed])
    assert row(c.bias_ids, 0) == [3, 40] and row(c.bias_ids, 1) == []
    np.testing.assert_array_equal(c.bias_values[0, :2], [2.5, -100.0])
    assert c.allowed_rows.tolist() == [1]
    mask = c.allowed_masks[0]
    assert [t for t in range(32 * len(mask)) if mask[t // 32] >> (t % 32) & 1] == [0, 33, 70]


def test_a_constraint_and_allowed_token_ids_intersect():
    both = seq_of([1], [], allowed_token_ids=[10, 11, 12, EOS, 90],
                  constraint=DigitsThenEos(range(11, 20), EOS, vocab_size=64, min_digits=0))
    mask = build_controls([both]).allowed_masks[0]
    assert [t for t in range(32 * len(mask)) if mask[t // 32] >> (t % 32) & 1] == [EOS, 11, 12]


def test_set_bits_marks_exactly_the_ids():
    mask = np.zeros(bitmask_words(100), np.int32)
    set_bits(mask, np.array([0, 31, 32, 99, 31], np.int32))
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [0, 31, 32, 99]
