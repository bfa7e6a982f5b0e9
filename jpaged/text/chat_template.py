"""Chat templates: a model's jinja2 template rendered the way Hugging Face transformers renders it.

Templates come from tokenizer_config.json ("chat_template": a string, or a list of {"name",
"template"} entries of which "default" is used) or from a chat_template.jinja file beside it. They
run in jinja2's immutable sandbox with transformers' settings: `trim_blocks` and `lstrip_blocks`,
the loop-controls extension, a `tojson` filter that does not HTML-escape, and the globals
`raise_exception(message)` and `strftime_now(format)`. Pure Python, no jax.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template failed to render: `raise_exception` in the template, or a jinja2 error."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & for HTML; chat templates want the plain JSON text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for `source` (cached: servers render the same template per request)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat_template: jinja2 syntax error at line {exc.lineno}: {exc.message}") from None


def _plain(value: Any, where: str) -> Any:
    """A copy of `value` made of JSON types only (what a sandboxed template may see)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ChatTemplateError(f"{where}: must be a finite number, got {value}")
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"{where}: must be JSON data (str, number, bool, list, dict), "
                            f"got {type(value).__name__}")


def check_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Validated plain copies of chat messages: each a dict with a str "role" and a "content".

    Keys whose value is None are dropped (OpenAI clients send content=None), as transformers does.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages: must be a list of {{'role', 'content'}} dicts, "
                                f"got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}]: must be a dict, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role: must be a string, got {message.get('role')!r}")
        checked.append({k: v for k, v in _plain(message, f"messages[{i}]").items() if v is not None})
    return checked


def render(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
           special_tokens: Mapping[str, str] | None = None, **variables: Any) -> str:
    """Renders chat template `source` over `messages`.

    `special_tokens` (bos_token, eos_token, ...) become template variables, as transformers passes
    its special_tokens_map; `variables` (tools, documents, enable_thinking, ...) override them.
    Raises ChatTemplateError with the template's message when it calls raise_exception.
    """
    context = {**(special_tokens or {}), **{k: _plain(v, k) for k, v in variables.items()}}
    try:
        return compile_template(source).render(messages=check_messages(messages),
                                               add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat_template: {exc}") from None
