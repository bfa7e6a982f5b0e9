"""The server's errors as OpenAI's error object, and request bodies parsed into request models.

Every error the server answers has OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, whatever failed: the content type, the JSON, a field's type or range (pydantic), a
route that does not exist, or a bug (500). `message` starts with the field at fault, which `param`
names too ("messages[0].content"), so a client can show it without parsing prose.

Bodies are read by `parse_body`, not by FastAPI: the content type must be application/json, the
JSON is decoded by Python's `json` (which keeps a lone UTF-16 surrogate such as "\\ud800" as a
character, so the field holding it can be named later; pydantic's own JSON parser refuses the
whole body), NaN and Infinity are refused naming the field that holds them (they are not JSON,
but Python's json.dumps writes them by default), and the models validate strictly:
a bool is never a number and a number is never a string.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


class RequestError(ValueError):
    """A request the server refuses (400 unless `status` says otherwise), naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


def error_body(message: str, param: str | None, kind: str = "invalid_request_error", code: int = 400) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _NonFinite(str):
    """NaN, Infinity or -Infinity where the body holds it: JSON has no such numbers, and the decoder
    keeps the constant as this marker so that the field holding it can be named."""


def _non_finite_at(value: Any, where: str = "") -> tuple[str, str] | None:
    """(field, constant) of the first NaN/Infinity marker in decoded JSON, in document order."""
    if isinstance(value, _NonFinite):
        return where, str(value)
    if isinstance(value, dict):
        children = ((f"{where}.{key}" if where else str(key), child) for key, child in value.items())
    elif isinstance(value, list):
        children = ((f"{where}[{index}]", child) for index, child in enumerate(value))
    else:
        return None
    for child_where, child in children:
        found = _non_finite_at(child, child_where)
        if found is not None:
            return found
    return None


def parse_body(body: bytes, content_type: str | None, model: type[Model]) -> Model:
    """`body` as a `model`, or RequestError: wrong content type, invalid JSON, or a field's error."""
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(f"the request body must be JSON with Content-Type: application/json, "
                           f"got {content_type or 'no Content-Type'}", None)
    try:
        data = json.loads(body, parse_constant=_NonFinite)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, nesting too deep
        raise RequestError(f"the request body is not valid JSON: {exc}", None) from None
    found = _non_finite_at(data)
    if found is not None:
        field, constant = found
        raise RequestError(f"{field or 'the request body'}: {constant} is not a JSON number "
                           "(JSON has no NaN or Infinity)", field or None)
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {_shown(data)}", None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _shown(value: Any) -> str:
    """A short JSON rendering of a value for an error message."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_type_tag(part: Any) -> bool:
    """True for the parts of a pydantic error location that name a union member, not a field:
    'str', 'list[int]', 'function-after[...]', 'StreamOptions', ..."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part
                                      or "-" in part or part[:1].isupper())


def _param(loc: tuple) -> str:
    """'messages[0].content' from ('messages', 0, 'content'), union member tags left out."""
    param = ""
    for part in loc:
        if _is_type_tag(part):
            continue
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    return param


def validation_error(errors: list[dict[str, Any]]) -> RequestError:
    """The first field's pydantic errors as one RequestError naming the field.

    A value that fits no member of a union (`prompt: 5`) gets one message listing the members.
    """
    first = errors[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, RequestError):  # a model validator's own error, with its field
        return raised
    param = _param(first.get("loc", ()))
    kind = first.get("type")
    if kind == "extra_forbidden":
        return RequestError(f"{param}: unrecognized request argument", param or None)
    if kind == "missing":
        return RequestError(f"{param}: field required", param or None)
    text = first.get("msg", "invalid value").removeprefix("Value error, ")
    loc = tuple(first.get("loc", ()))
    tag_at = next((i for i, part in enumerate(loc) if _is_type_tag(part)), None)
    if tag_at is not None:  # the value fit no member of a union: name the union's field and its members
        members = [e["loc"][tag_at] for e in errors if tuple(e["loc"][:tag_at]) == loc[:tag_at]
                   and len(e["loc"]) > tag_at and _is_type_tag(e["loc"][tag_at])]
        if len(set(members)) > 1:
            union_param = _param(loc[:tag_at])
            # pydantic reports the innermost input: the field's whole value is the input of an
            # error at a member itself (no index after the tag), when there is one.
            whole = [e["input"] for e in errors
                     if len(e["loc"]) == tag_at + 1 and tuple(e["loc"][:tag_at]) == loc[:tag_at]]
            got = f", got {_shown(whole[0])}" if whole else ""
            return RequestError(f"{union_param}: expected one of {', '.join(dict.fromkeys(members))}{got}", union_param)
    return RequestError(f"{param}: {text} (got {_shown(first.get('input'))})", param)

