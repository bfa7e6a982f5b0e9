"""Stop strings: find them in a sequence's growing text, across token boundaries, and stream safely.

A stop string can arrive split over several tokens ("\\n\\n" as "\\n" + "\\n"), or a token can
carry a stop string with text after it. `StopChecker.append(new_text)` searches only the window
where a new match can be, the last (longest stop - 1) old characters plus the new text, so a step
costs O(new text + longest stop), not O(output). The first match in the text wins: the one that
ends first (as if the text had arrived a character at a time), and of those the longest, so the
result does not depend on how tokens cut the text. The text is cut before the stop string (or after
it with `include_stop_str_in_output`), as in vLLM and the OpenAI API.

Streaming: `take_delta()` hands out new text except a tail that could still grow into a stop
string, so a client never sees text that a later token turns into a stop. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check_stops(stop: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = [stop]
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop[{i}]: must be a non-empty string, got {s!r}")
    return tuple(dict.fromkeys(stop))


class StopChecker:
    """One sequence's output text, checked for stop strings as it grows."""

    __slots__ = ("stops", "include_stop", "stopped_by", "_chunks", "_tail", "_unsent", "_sent", "_max_len",
                 "_prefixes_by_last_char")

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False) -> None:
        """`stop`: the stop strings (a str is one stop string); empty strings are an error."""
        self.stops = _check_stops(stop)
        self.include_stop = include_stop_str_in_output
        self.stopped_by: str | None = None  # the stop string that ended the text, once one has
        self._max_len = max(map(len, self.stops), default=0)
        # Proper prefixes of the stop strings by their last character, longest first: a held-back
        # tail must end with the text's last character, so most steps test no prefix at all.
        prefixes = sorted({s[:k] for s in self.stops for k in range(1, len(s))}, key=len, reverse=True)
        self._prefixes_by_last_char: dict[str, list[str]] = {}
        for p in prefixes:
            self._prefixes_by_last_char.setdefault(p[-1], []).append(p)
        self._chunks: list[str] = []  # the text, joined on demand (no quadratic concatenation)
        self._tail = ""  # the text's last max_len - 1 characters: where a new match can start
        self._unsent: list[str] = []  # text after the first _sent characters, not yet returned
        self._sent = 0  # characters take_delta has returned

    @property
    def text(self) -> str:
        """The output text so far (ending before / after the stop string once stopped)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def append(self, new_text: str) -> str | None:
        """Adds `new_text`; returns the stop string it completes (the text is then cut), else None."""
        if self.stopped_by is not None:
            raise RuntimeError("append after a stop string ended the text")
        if not new_text:
            return None
        window = self._tail + new_text
        best = None  # (end, -length, start, stop) in window coordinates: first end, then longest
        for s in self.stops:
            # A match must end inside new_text: the old text had none.
            start = window.find(s, max(0, len(self._tail) - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), -len(s)) < best[:2]):
                best = (start + len(s), -len(s), start, s)
        if best is None:
            self._chunks.append(new_text)
            self._unsent.append(new_text)
            self._tail = window[max(0, len(window) - self._max_len + 1):] if self._max_len > 1 else ""
            return None
        end, _, start, stop = best
        text = self.text
        cut = len(text) - len(self._tail) + (end if self.include_stop else start)  # index into text + new_text
        self._chunks = [(text + new_text)[:cut]]
        self._unsent = [self._chunks[0][self._sent:]]
        self.stopped_by = stop
        return stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        if not self._tail:
            return 0
        for prefix in self._prefixes_by_last_char.get(self._tail[-1], ()):
            if self._tail.endswith(prefix):
                return len(prefix)
        return 0

    def take_delta(self, finished: bool = False) -> str:
        """Text not returned before, except a tail that may still become a stop string.

        Everything is final once a stop string matched, or with `finished` (EOS, length, abort).
        """
        unsent = "".join(self._unsent)
        hold = 0 if finished or self.stopped_by is not None else min(self._held_back(), len(unsent))
        delta = unsent[:len(unsent) - hold]
        self._unsent = [unsent[len(delta):]] if hold else []
        self._sent += len(delta)
        return delta
