"""Stop strings across chunk boundaries, the first match winning, and streaming that never retracts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.text.stop_strings import StopChecker


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text arriving one character at a time: the first stop string to be complete wins (longest on ties)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return text[:end if include else end - len(stop)], stop
    return text, None


def feed(checker: StopChecker, chunks: list[str]) -> list[str]:
    """Appends chunks until a stop; returns what a stream would have sent after each chunk."""
    sent = []
    for chunk in chunks:
        stop = checker.append(chunk)
        sent.append(checker.take_delta())
        if stop is not None:
            break
    sent.append(checker.take_delta(finished=True))
    return sent


@pytest.mark.parametrize("chunks, stops, include, want_text, want_stop", [
    (["Hello", " wor", "ld", "!"], ["world"], False, "Hello ", "world"),  # across three chunks
    (["a\n", "\nb"], ["\n\n"], False, "a", "\n\n"),
    (["a\n", "\nb"], ["\n\n"], True, "a\n\n", "\n\n"),
    (["xyz STOP tail"], ["STOP"], False, "xyz ", "STOP"),  # inside one chunk, text after it dropped
    (["STOP"], ["STOP"], False, "", "STOP"),  # at the very start
    (["abcd"], ["cd", "bc"], False, "a", "bc"),  # ends first wins, not list order
    (["xab", "c"], ["bc", "abc"], False, "x", "abc"),  # same end: the longest
    (["no", " stop"], ["zzz"], False, "no stop", None),
    (["日本", "語です"], ["語"], False, "日本", "語"),
])
def test_examples(chunks, stops, include, want_text, want_stop):
    checker = StopChecker(stops, include_stop_str_in_output=include)
    sent = feed(checker, chunks)
    assert (checker.text, checker.stopped_by) == (want_text, want_stop)
    assert "".join(sent) == want_text


def test_streaming_holds_back_only_possible_stop_prefixes():
    checker = StopChecker(["</s>", "\n\n"])
    checker.append("value <")
    assert checker.take_delta() == "value "  # "<" may start "</s>"
    checker.append("b>\n")
    assert checker.take_delta() == "<b>"  # "<b" is no stop prefix any more; "\n" may start "\n\n"
    checker.append("x")
    assert checker.take_delta() == "\nx"
    assert checker.append("\n\nrest") == "\n\n" and checker.take_delta() == "" and checker.text == "value <b>\nx"


def test_bad_stops_and_use_after_stop():
    with pytest.raises(ValueError, match=r"stop\[1\]: must be a non-empty string"):
        StopChecker(["ok", ""])
    checker = StopChecker("x")  # one string is one stop string, not a list of characters
    assert checker.stops == ("x",)
    checker.append("axb")
    with pytest.raises(RuntimeError):
        checker.append("more")


alphabet = st.text("ab\n<", max_size=30)


@settings(max_examples=400, deadline=None)
@given(text=alphabet, stops=st.lists(st.text("ab\n<", min_size=1, max_size=4), max_size=3),
       include=st.booleans(), cuts=st.lists(st.integers(0, 30), max_size=8))
def test_any_chunking_gives_the_character_by_character_result(text, stops, include, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    checker = StopChecker(stops, include_stop_str_in_output=include)
    sent = feed(checker, chunks)
    assert (checker.text, checker.stopped_by) == reference(text, stops, include)
    streamed = ""
    for piece in sent:  # the stream only ever extends, and never shows text the stop later cut
        streamed += piece
        assert checker.text.startswith(streamed)
    assert streamed == checker.text
