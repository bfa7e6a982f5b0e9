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


def _clamped(logprob: float) -> float:
    """-inf as the finite -9999.0 OpenAI (and vLLM) send: JSON has no infinity."""
    return max(logprob, -9999.0)


def completion_logprobs(strings: Callable[[int], str], token_ids: list[int],
                        entries: list[dict[int, float] | None] | None, num_top: int,
                        offset: int) -> tuple[dict | None, int]:
    """The legacy completions `logprobs` object of `token_ids` (per token {id: logprob}, or None for
    the first prompt token of an echo: then its logprob and top entry are null), text offsets
    starting at `offset`; the top entries as vLLM counts them (the token's own, then `num_top`)."""
    if entries is None:
        return None, offset
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = strings(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(_clamped(entry[token_id]))
        top.append({strings(t): _clamped(lp) for i, (t, lp) in enumerate(entry.items()) if i <= num_top})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def prompt_logprobs_json(strings: Callable[[int], str], entries: list[dict[int, float] | None],
                         ranks: list[int | None], num_top: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` (chat response, completion choice): per prompt position None or
    {token id: {logprob, rank, decoded_token}}, the prompt's token first with its own rank, then the
    top `num_top` ranked 1, 2, ... (the prompt's token, if among them, holds its place in that order)."""
    out: list[dict | None] = []
    for entry, rank in zip(entries, ranks):
        if entry is None:
            out.append(None)
            continue
        (token, logprob), *rest = entry.items()
        top = [t for t, _ in rest]
        if rank <= num_top:  # the prompt's token is one of the top: its place among them
            top.insert(rank - 1, token)
        item = {str(token): {"logprob": _clamped(logprob), "rank": rank, "decoded_token": strings(token)}}
        for i, t in enumerate(top[:num_top], 1):
            if t != token:
                item[str(t)] = {"logprob": _clamped(entry[t]), "rank": i, "decoded_token": strings(t)}
        out.append(item)
    return out


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
