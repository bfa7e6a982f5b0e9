"""Structured outputs at the server's door: OpenAI's `response_format` and vLLM's `structured_outputs`.

Both routes take either (not both): `response_format` {"type": "text"} (nothing asked),
{"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}; `structured_outputs` with exactly one of json, regex, choice, grammar,
json_object, and vLLM's disable_any_whitespace / disable_additional_properties. They become a
StructuredOutputsParams; the handler compiles it in a worker thread (jpaged.text.structured_output)
so that a malformed schema, regex or grammar is a 400 naming the request field it came from
(`response_format.json_schema.schema`, `structured_outputs.regex`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jpaged.core.constraints import StructuredOutputsParams
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.serve.errors import RequestError
from jpaged.text.structured_output import with_constraint
from jpaged.text.tokenizer import Tokenizer

_STRICT = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema (OpenAI's shape)."""

    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output follows the schema here, strict or not


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (nothing asked), json_object or json_schema."""

    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise RequestError("response_format.json_schema: required with type 'json_schema', and only with it "
                               f"(got type '{self.type}')", "response_format.json_schema")
        return self


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs request field (its StructuredOutputsParams, the options jpaged has)."""

    model_config = _STRICT

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # one backend here: there is nothing to fall back to either way

    def params(self) -> StructuredOutputsParams:
        """The StructuredOutputsParams (its checks: exactly one kind, a non-empty regex / choice),
        or RequestError naming the field."""
        try:
            return StructuredOutputsParams(
                json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                json_object=self.json_object, disable_any_whitespace=self.disable_any_whitespace,
                disable_additional_properties=self.disable_additional_properties)
        except (TypeError, ValueError) as exc:  # "structured_outputs[.field]: why"
            raise RequestError(str(exc), str(exc).split(":", 1)[0]) from None


def structured_spec(response_format: ResponseFormat | None,
                    structured_outputs: StructuredOutputsRequest | None) -> tuple[StructuredOutputsParams, str] | None:
    """(spec, the request field a compile error names) of a request, or None when it asks for none;
    RequestError for a request that asks for two."""
    asks_format = response_format is not None and response_format.type != "text"
    if asks_format and structured_outputs is not None:
        raise RequestError("structured_outputs: give response_format or structured_outputs, not both",
                           "structured_outputs")
    if asks_format:
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True), "response_format"
        return StructuredOutputsParams(json=response_format.json_schema.schema_), "response_format.json_schema.schema"
    if structured_outputs is None:
        return None
    spec = structured_outputs.params()
    return spec, f"structured_outputs.{spec.kind}"


def compiled(params: list[SamplingParams], tokenizer: Tokenizer | None, field: str) -> list[SamplingParams]:
    """`params` with their structured outputs compiled (the first compiles, the others copy the
    cached grammar); a malformed schema, regex or grammar is a RequestError naming `field`.
    Compiling takes milliseconds to seconds: call it off the event loop."""
    try:
        return [with_constraint(p, tokenizer, field) for p in params]
    except ValueError as exc:  # "<field>: why"
        raise RequestError(str(exc), str(exc).split(":", 1)[0]) from None
