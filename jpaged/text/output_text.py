"""One sequence's generated text, token by token: incremental detokenization + stop strings.

What the engine keeps per output sequence: one `add_token` call per generated token (O(1) for
byte-level tokenizers plus a window search per stop string), `finish` when the sequence ends for
another reason (EOS, max_tokens, abort), `take_delta` when streaming. Pure Python, no jax.
"""

from __future__ import annotations

from collections.abc import Sequence

from jpaged.text.detokenizer import make_detokenizer
from jpaged.text.stop_strings import StopChecker
from jpaged.text.tokenizer import Tokenizer


class OutputText:
    """The text of one output sequence and the stop string that ended it, if any."""

    __slots__ = ("_detokenizer", "_stops", "_finished")

    def __init__(self, tokenizer: Tokenizer, *, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> None:
        """`stop` strings end the text; `prompt_ids` give context to non-byte-level detokenizers."""
        self._detokenizer = make_detokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                                             prompt_ids=prompt_ids)
        self._stops = StopChecker(stop, include_stop_str_in_output)
        self._finished = False

    def add_token(self, token_id: int) -> str | None:
        """Appends a generated token; returns the stop string it completed (finish the sequence), else None."""
        if self._finished:
            raise RuntimeError("add_token after the text finished")
        stop = self._stops.append(self._detokenizer.add(token_id))
        self._finished = stop is not None
        return stop

    def finish(self) -> str | None:
        """Ends the text: held-back bytes become text (U+FFFD if incomplete); returns a stop string they complete."""
        if self._finished:
            return None
        self._finished = True
        return self._stops.append(self._detokenizer.flush())

    @property
    def text(self) -> str:
        """The text so far; once finished, the whole output text, cut at a stop string."""
        return self._stops.text

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stops.stopped_by

    @property
    def finished(self) -> bool:
        """True after a stop string or `finish`."""
        return self._finished

    def take_delta(self) -> str:
        """Text for a stream: what is new since the last call, less a tail that may become a stop string."""
        return self._stops.take_delta(finished=self._finished)
