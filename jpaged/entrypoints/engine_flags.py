"""The one list of engine arguments: `jpaged serve`'s flags, `LLM(...)`'s keywords and --config's
YAML keys are the fields of ModelConfig, CacheConfig and SchedulerConfig, by the same name:
`--max-num-seqs 64` = `LLM(model, max_num_seqs=64)` = `scheduler: {max_num_seqs: 64}`.

`add_engine_flags` builds one argparse group per section from the dataclasses: each flag's help is
its field's attribute docstring (jpaged.config.docs), a Literal type gives the choices, a bool
gives `--x` / `--no-x` (argparse.BooleanOptionalAction, as vLLM), ints and floats are parsed as
such and range-checked by the config itself (the error names the field, e.g. `cache.watermark`).
Every flag defaults to None: not given, --config (or the dataclass default) decides.
`FLAG_EXCEPTIONS` lists the fields that get no generated flag, and why. Pure Python, no jax:
`jpaged --help` imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import types
import typing
from typing import Any, Literal

from jpaged.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from jpaged.config.docs import attribute_docs

# The EngineConfig sections that engine arguments set, in `--help` order.
SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
# `model` (a preset name or a local Hugging Face directory) sets these; they are no engine argument.
FROM_MODEL = ("name", "checkpoint")

# Engine argument (keyword) name -> the EngineConfig section that holds it.
ENGINE_ARGS: dict[str, str] = {f.name: section for section, cls in SECTIONS.items()
                               for f in dataclasses.fields(cls) if f.name not in FROM_MODEL}

# The EngineConfig fields ("section.field", or a top-level field) without a generated flag, and why.
# The multi-process fields have hand-written flags of the same name (jpaged.entrypoints.cli):
# `jpaged serve` reads them itself, before any engine is built, to decide who serves and who follows.
FLAG_EXCEPTIONS: dict[str, str] = {
    "model.name": "set by --model (a preset name, or a Hugging Face directory's name)",
    "model.checkpoint": "set by --model (a local Hugging Face directory)",
    "model.coordinator_address": "--coordinator-address, in the multi-process group",
    "model.num_processes": "--num-processes, in the multi-process group (default 1)",
    "model.process_id": "--process-id, in the multi-process group (default 0)",
    "executor": "YAML only: the server and LLM run the real model (jax); sim is jpaged.paper's",
    "speculative": "one JSON flag, as vLLM's: --speculative-config (LLM(speculative_config=...))",
}
# The engine argument of the `speculative:` section, whole: a dict, a JSON object or a SpeculativeConfig.
SPECULATIVE_ARG = "speculative_config"


def add_engine_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """Adds a group of flags per engine config section to `parser`; returns the groups by section
    name (a front end may add its own engine-related flags to them)."""
    groups = {}
    for section, cls in SECTIONS.items():
        groups[section] = group = parser.add_argument_group(
            f"{section} ({cls.__name__}; override the `{section}:` section of --config)",
            inspect.cleandoc(cls.__doc__).replace("%", "%%"))
        docs = attribute_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if f"{section}.{field.name}" in FLAG_EXCEPTIONS:
                continue
            help_text = " ".join(docs[field.name].split()).replace("%", "%%") + _default_text(field.default)
            group.add_argument("--" + field.name.replace("_", "-"), dest=field.name, default=None, help=help_text,
                               **_parse_options(f"{section}.{field.name}", hints[field.name]))
    groups["speculative"] = group = parser.add_argument_group(
        "speculative (SpeculativeConfig; overrides the `speculative:` section of --config)",
        inspect.cleandoc(SpeculativeConfig.__doc__).replace("%", "%%"))
    fields = "; ".join(f"{name}: {' '.join(doc.split())}" for name, doc in attribute_docs(SpeculativeConfig).items())
    group.add_argument("--speculative-config", dest=SPECULATIVE_ARG, default=None,
                       help=("a JSON object of its fields, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                             "\"prompt_lookup_max\": 4}'. " + fields).replace("%", "%%"))
    return groups


def engine_args_from(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments given on the command line (flags left at None are not given)."""
    return {name: getattr(args, name) for name in (*ENGINE_ARGS, SPECULATIVE_ARG) if getattr(args, name, None) is not None}


def _parse_options(field: str, hint: Any) -> dict[str, Any]:
    """add_argument's type / choices / action for a field annotated `hint` (None arms dropped)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        if len(arms) != 1:
            raise TypeError(f"{field}: no flag for the type {hint}")
        hint = arms[0]
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if hint in (int, float, str):
        return {"type": hint}
    raise TypeError(f"{field}: no flag for the type {hint}")


def _default_text(default: Any) -> str:
    """' (default: ...)' for help; nothing for None, whose meaning the field's doc explains."""
    if default is None or default is dataclasses.MISSING:
        return ""
    return f" (default: {str(default).lower() if isinstance(default, bool) else default})"

