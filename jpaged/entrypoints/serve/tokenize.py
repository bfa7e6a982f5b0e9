"""/tokenize, /detokenize and /tokenizer_info in vLLM's shapes (what lm-eval's remote tokenizer calls).

    POST /tokenize   {"prompt": str} or {"messages": [...]} (+ add_special_tokens, return_token_strs, ...)
                     -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info -> tokenizer_config.json's settings: bos / eos / pad tokens, chat_template, ...

lm-eval's `tokenizer_backend=remote` reads /tokenizer_info (it needs `eos_token`), encodes with
/tokenize (`add_special_tokens: false`) and decodes with /detokenize. Both run in a worker thread:
the text may be megabytes.
"""

from __future__ import annotations

from typing import Any

from jpaged.entrypoints.serve.chat_prompt import chat_prompt
from jpaged.entrypoints.serve.errors import RequestError
from jpaged.entrypoints.serve.protocol import DetokenizeRequest, TokenizeRequest
from jpaged.text.tokenizer import Tokenizer, check_encodable


def _need(tokenizer: Tokenizer | None, field: str) -> Tokenizer:
    if tokenizer is None:
        raise RequestError(f"{field}: this model has no tokenizer (it serves token ids only)", field)
    return tokenizer


def tokenize(tokenizer: Tokenizer | None, body: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenize answer for `body`."""
    if body.messages is not None:
        ids, _ = chat_prompt(tokenizer, body)
    else:
        tokenizer = _need(tokenizer, "prompt")
        try:
            check_encodable(body.prompt, "prompt")
        except ValueError as exc:
            raise RequestError(str(exc), "prompt") from None
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode_batch([body.prompt], add_special_tokens=add_special)[0]  # without the GIL
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        answer["token_strs"] = [tokenizer.id_to_token(t) for t in ids]
    return answer


def detokenize(tokenizer: Tokenizer | None, body: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's /detokenize answer: the text of the ids (special tokens kept, as vLLM)."""
    tokenizer = _need(tokenizer, "tokens")
    try:
        tokenizer.check_ids(body.tokens, "tokens")
    except ValueError as exc:
        raise RequestError(str(exc), "tokens") from None
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}


def tokenizer_info(tokenizer: Tokenizer | None) -> dict[str, Any]:
    """What vLLM's /tokenizer_info gives: the special tokens, the chat template, the class name."""
    tokenizer = _need(tokenizer, "tokenizer")
    info: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer.special_tokens}
    if tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
