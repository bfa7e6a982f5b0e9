"""Engine outputs as OpenAI JSON: completion and chat choices, stream chunks, logprobs, usage.

Plain dicts (serialised with `json.dumps`): a stream sends one chunk per request per engine step,
so building them stays cheap. Token strings for logprobs are the tokenizer's decode of each id
alone (a byte-level token holding part of a character decodes to U+FFFD, as in vLLM), cached.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from jpaged.core.outputs import CompletionOutput
from jpaged.text.tokenizer import Tokenizer


class TokenStrings:
    """id -> its text alone (special tokens spelled out), cached per id."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (self._tokenizer.decode([token_id], skip_special_tokens=False) if self._tokenizer is not None
                    else f"token_id:{token_id}")
            self._cache[token_id] = text
        return text


def completion_logprobs(strings: Callable[[int], str], c: CompletionOutput, offset: int) -> tuple[dict | None, int]:
    """The legacy completions `logprobs` object of `c`'s tokens, text offsets starting at `offset`."""
    if c.logprobs is None:
        return None, offset
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = strings(token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id))
        top.append({strings(t): lp for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def chat_logprobs(strings: Callable[[int], str], c: CompletionOutput, num_top: int) -> dict | None:
    """The chat `logprobs` object ({"content": [{token, logprob, bytes, top_logprobs}]}) of `c`'s tokens."""
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        text = strings(token_id)
        top = [{"token": strings(t), "logprob": lp, "bytes": list(strings(t).encode())}
               for t, lp in list(entry.items())[:num_top]]
        content.append({"token": text, "logprob": entry.get(token_id), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def as_token_id(token_id: int) -> str:
    """A token spelled by its id (vLLM's return_tokens_as_token_ids): any token, even a partial
    character, round-trips through JSON."""
    return f"token_id:{token_id}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else _dumps(payload)}\n\n"


class ResponseHeader:
    """The id / object / created / model fields every response and chunk of one request repeats."""

    def __init__(self, request_id: str, obj: str, model: str):
        self.fields = {"id": request_id, "object": obj, "created": int(time.time()), "model": model}
        self._chunk_prefix = "data: " + _dumps(self.fields)[:-1] + ',"choices":'  # serialised once

    def __call__(self, **rest) -> dict:
        return {**self.fields, **rest}

    def chunk(self, choices: list[dict], extra: dict | None = None) -> str:
        """A stream chunk's event: the header fields, `choices` and `extra` fields (the hot path of a stream)."""
        rest = "".join(f",{_dumps(k)}:{_dumps(v)}" for k, v in extra.items()) if extra else ""
        return f"{self._chunk_prefix}{_dumps(choices)}{rest}}}\n\n"


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"))
