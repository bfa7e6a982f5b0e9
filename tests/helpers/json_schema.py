"""A small JSON Schema validator for the tests of structured outputs (no jsonschema dependency): the
keywords the tests' schemas use, each checked as the specification defines it."""

from __future__ import annotations

import re
from typing import Any

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def errors(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Why `value` does not satisfy `schema` (empty: it does). Supports type, enum, const, properties,
    required, additionalProperties (bool), items, minItems / maxItems, minimum / maximum,
    minLength / maxLength and pattern; any other keyword is an error of the test itself."""
    known = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
             "maxItems", "minimum", "maximum", "minLength", "maxLength", "pattern", "title", "description"}
    unknown = set(schema) - known
    if unknown:
        raise ValueError(f"the test validator does not implement {sorted(unknown)}")
    found = []
    types = schema.get("type")
    if types is not None and not any(_is_type(value, t) for t in ([types] if isinstance(types, str) else types)):
        return [f"{path}: {value!r} is not of type {types}"]
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{path}: {value!r} not in {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        found.append(f"{path}: {value!r} != {schema['const']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        found += [f"{path}: {k!r} missing" for k in schema.get("required", []) if k not in value]
        for key, item in value.items():
            if key in props:
                found += errors(item, props[key], f"{path}.{key}")
            elif schema.get("additionalProperties", True) is False:
                found.append(f"{path}: {key!r} not allowed")
    if isinstance(value, list):
        if "items" in schema:
            for i, item in enumerate(value):
                found += errors(item, schema["items"], f"{path}[{i}]")
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            found.append(f"{path}: {len(value)} items")
    if _is_type(value, "number") and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        found.append(f"{path}: {value} out of range")
    if isinstance(value, str):
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value)):
            found.append(f"{path}: length {len(value)}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            found.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    return found
