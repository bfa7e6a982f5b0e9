"""A chat request's prompt: its messages checked, rendered by the model's template, and encoded.

What vLLM does before the template, done the same way: text content parts are the only parts a
text model takes (any other part is refused, naming it); a `developer` message becomes a `system`
message when the template does not know the role, and the system messages then merge into one
first message (OpenAI's newer clients send `developer` where older ones sent `system`); `tools`,
`documents`, `reasoning_effort` and `chat_template_kwargs` are template variables;
`continue_final_message` cuts the rendered prompt right after the last message's text, as
transformers does, so the model continues that message. Text that cannot be encoded (a lone
surrogate) is refused naming its message. Runs in a worker thread: rendering and encoding a long
conversation must not hold up the event loop.
"""

from __future__ import annotations

from typing import Any

from jpaged.entrypoints.serve.errors import RequestError
from jpaged.text.tokenizer import Tokenizer, check_encodable

# apply_chat_template's and render's own arguments: chat_template_kwargs may not replace them.
_RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tokenize", "chat_template", "special_tokens",
                                 "source"})


def _encodable(text: str, field: str) -> None:
    """RequestError naming `field` when `text` has no UTF-8 form (a lone surrogate)."""
    try:
        check_encodable(text, field)
    except ValueError as exc:
        raise RequestError(str(exc), field) from None


def _text_of(content: Any, field: str) -> str | None:
    """The text of a message's content (a string, or text parts); other parts are refused."""
    if content is None or isinstance(content, str):
        if content is not None:
            _encodable(content, field)
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise RequestError(f"{field}[{j}].type: only text parts are supported (this model reads text), "
                               f"got {kind!r}", f"{field}[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{field}[{j}].text: must be a string", f"{field}[{j}].text")
        _encodable(text, f"{field}[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def checked_messages(body: Any, template: str | None) -> list[dict[str, Any]]:
    """The messages as the template sees them: plain dicts (unset keys left out), content checked,
    `developer` turned into `system` unless the template names the role."""
    messages = []
    for i, message in enumerate(body.messages):
        _text_of(message.content, f"messages[{i}].content")
        messages.append(message.model_dump(exclude_none=True))
    if template is not None and any(m["role"] == "developer" for m in messages) and not (
            "'developer'" in template or '"developer"' in template):
        messages = _developer_as_system(messages)
    return messages


def _developer_as_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for templates without the role: developer -> system, all system text merged
    (blank line between) into one first message, since many templates allow only a first system message."""
    system, rest = [], []
    for m in messages:
        if m["role"] in ("developer", "system"):
            text = _text_of(m.get("content"), "content")
            if text:
                system.append(text)
        else:
            rest.append(m)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def template_variables(body: Any) -> dict[str, Any]:
    """What the template gets besides the messages: tools, documents, reasoning effort, and the
    request's chat_template_kwargs (which may not replace the renderer's own arguments)."""
    variables: dict[str, Any] = {}
    if body.tools is not None:
        variables["tools"] = body.tools
    if getattr(body, "documents", None) is not None:
        variables["documents"] = body.documents
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:  # vLLM: templates that gate thinking read enable_thinking
        variables.update(reasoning_effort=effort, enable_thinking=effort != "none")
    for key, value in (body.chat_template_kwargs or {}).items():
        if key in _RESERVED_VARIABLES:
            raise RequestError(f"chat_template_kwargs.{key}: is the renderer's own argument, not a template "
                               "variable", f"chat_template_kwargs.{key}")
        variables[key] = value
    return variables


def _open_final_message(text: str, final: dict[str, Any]) -> str:
    """`text` cut right after the last message's content (transformers' continue_final_message)."""
    content = _text_of(final.get("content"), "content")
    if not content or content.strip() not in text:
        raise RequestError("continue_final_message: the last message's text does not appear in the rendered "
                           "prompt (nothing to continue)", "continue_final_message")
    at = text.rindex(content.strip())
    # The template may have trimmed the message's leading or trailing spaces: keep what it wrote.
    if text[at: at + len(content.lstrip())] == content:
        return text[: at + len(content.lstrip())]
    return text[: at + len(content.strip())]


def chat_prompt(tokenizer: Tokenizer | None, body: Any) -> tuple[list[int], str]:
    """(token ids, text) of a chat request's prompt; RequestError or ChatTemplateError (a 400) if
    it cannot be built."""
    if tokenizer is None:
        raise RequestError("messages: this model has no tokenizer (and no chat template)", "messages")
    messages = checked_messages(body, tokenizer.chat_template)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                         **template_variables(body))
    if body.continue_final_message:
        text = _open_final_message(text, messages[-1])
    _encodable(text, "messages")  # a lone surrogate in a tool, a document or a variable
    add_special = bool(body.add_special_tokens)
    # encode_batch: the Rust side encodes without the GIL, so the event loop runs meanwhile.
    return tokenizer.encode_batch([text], add_special_tokens=add_special)[0], text
