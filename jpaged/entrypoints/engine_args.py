"""From `model=...` and keyword engine arguments to an engine, its tokenizer and its model card.

What `jpaged.LLM`, `AsyncLLMEngine.from_model` and `jpaged serve` share. `model` is a preset name
(jpaged.config.presets: dummy seeded weights, no tokenizer) or a local Hugging Face directory
(config.json + safetensors; tokenizer.json when it has one). Engine arguments are the fields of
ModelConfig, CacheConfig and SchedulerConfig by name (`block_size=32`, `max_num_seqs=64`,
`enable_prefix_caching=True`, `num_host_cache_blocks=4096`, `eviction_policy="arc"`,
`dtype="bfloat16"`, ...; jpaged.entrypoints.engine_flags lists them and makes them `jpaged serve`'s
flags); they override an optional base `config` (an EngineConfig or the path of its YAML).
`speculative_config` (vLLM's name: a dict or JSON object of SpeculativeConfig's fields) sets the
`speculative:` section whole.
`load_engine` also pre-stores `pinned_prefixes`. The executor is the real (JAX) one.
Pure Python: the model loads only when `load_engine` builds the executor. (The paper's systems, simulated or not,
are built by `jpaged.paper.systems.build_engine`.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jpaged.config import EngineConfig, SpeculativeConfig, config_from_dict, load_config
from jpaged.config.checks import show
from jpaged.config.presets import preset_names
from jpaged.engine import LLMEngine
from jpaged.entrypoints.engine_flags import ENGINE_ARGS, SECTIONS, SPECULATIVE_ARG
from jpaged.executors.base import Executor
from jpaged.text.output_processor import prompt_ids
from jpaged.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a preset, or a local HF directory (with its tokenizer, if any)."""

    name: str  # what the user called it (the served model id)
    directory: Path | None  # the HF directory; None for a preset
    max_position_embeddings: int | None  # the model's longest context, when config.json says


def resolve_model(model: str) -> ModelSource:
    """A preset name or a local Hugging Face directory; ValueError naming `model` otherwise."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model: must be a preset name or a local Hugging Face directory, got {model!r}")
    path = Path(model)
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model: {model} is a directory without config.json (not a Hugging Face model dir)")
        try:
            hf_config = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"model: {config_path} is not valid JSON ({exc})") from None
        return ModelSource(model, path, hf_config.get("max_position_embeddings"))
    if model in preset_names():
        return ModelSource(model, None, None)
    raise ValueError(f"model: {model!r} is neither a local directory nor a preset; "
                     f"presets: {', '.join(preset_names())}")


def engine_config(model: str, config: EngineConfig | str | Path | None = None, **engine_args: Any) -> EngineConfig:
    """The EngineConfig of `model` (see the module docstring); unknown arguments name the allowed ones.

    max_model_len: an explicit engine argument must fit the model's max_position_embeddings; a
    value from `config` (or the default) is lowered to it.
    """
    source = resolve_model(model)
    speculative = _speculative_config(engine_args.pop(SPECULATIVE_ARG, None))
    unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
    if unknown:
        raise TypeError(f"unknown engine argument(s) {', '.join(unknown)}; allowed: "
                        f"{', '.join(sorted([*ENGINE_ARGS, SPECULATIVE_ARG]))}")
    if config is None:
        base = EngineConfig()
    elif isinstance(config, EngineConfig):
        base = config
    else:
        base = load_config(config, EngineConfig)
    if base.executor != "jax":
        raise ValueError(f"executor: the text front end runs the real model ('jax'), got {base.executor!r}")
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in engine_args.items():
        sections[ENGINE_ARGS[key]][key] = value
    if source.directory is not None:
        sections["model"].update(name=source.directory.resolve().name, checkpoint=str(source.directory))
    else:
        sections["model"].update(name=model, checkpoint=None)
    limit = source.max_position_embeddings
    if limit is not None:
        asked = engine_args.get("max_model_len")
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len: {asked} exceeds the model's max_position_embeddings ({limit})")
        if asked is None and base.scheduler.max_model_len > limit:
            log.info("max_model_len %d lowered to the model's max_position_embeddings %d",
                     base.scheduler.max_model_len, limit)
            sections["scheduler"]["max_model_len"] = limit
    parts = {name: dataclasses.replace(getattr(base, name), **values) for name, values in sections.items()}
    if speculative is not None:
        parts["speculative"] = speculative
    return dataclasses.replace(base, **parts)


def _speculative_config(value: Any) -> SpeculativeConfig | None:
    """The `speculative_config` engine argument (vLLM's): a SpeculativeConfig, a dict of its
    fields or that dict as a JSON object (`jpaged serve --speculative-config`); None: not given."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{SPECULATIVE_ARG}: not a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise TypeError(f"{SPECULATIVE_ARG}: must be a dict (or JSON object) of SpeculativeConfig fields, got "
                        f"{type(value).__name__} {show(value)}")
    return config_from_dict(SpeculativeConfig, value, source=SPECULATIVE_ARG)


def load_tokenizer(model: str, tokenizer: str | None = None) -> Tokenizer | None:
    """The tokenizer of `tokenizer` (a local HF dir), else of the model's dir; None when it has none."""
    if tokenizer is not None:
        return Tokenizer.from_dir(tokenizer)
    source = resolve_model(model)
    if source.directory is not None and (source.directory / "tokenizer.json").is_file():
        return Tokenizer.from_dir(source.directory)
    return None


def load_engine(model: str, config: EngineConfig | str | Path | None = None, tokenizer: str | None = None,
                pinned_prefixes: Sequence[str | Sequence[int]] = (), executor: Executor | None = None,
                **engine_args: Any) -> tuple[LLMEngine, Tokenizer | None]:
    """An LLMEngine for `model` that stops at the tokenizer's EOS ids, and that tokenizer (or None).

    `pinned_prefixes` (texts, encoded as prompts are, or token id lists) are pre-stored in the
    prefix cache before the engine serves (`LLMEngine.pin_prefix`; needs enable_prefix_caching).
    `executor`: one built already for this config (a multi-process run's BroadcastExecutor); None
    builds the real one.
    """
    pinned_prefixes = _check_prefix_list(pinned_prefixes)
    text = load_tokenizer(model, tokenizer)
    engine = LLMEngine(engine_config(model, config, **engine_args), executor=executor,
                       eos_token_ids=text.eos_token_ids if text is not None else ())
    if text is not None and engine.vocab_size is not None and text.vocab_size > engine.vocab_size:
        raise ValueError(f"tokenizer: {text.vocab_size} ids do not fit the model's vocabulary of {engine.vocab_size}")
    for i, prefix in enumerate(pinned_prefixes):
        field = f"pinned_prefixes[{i}]"
        ids, _ = prompt_ids(prefix, text, field)
        try:
            engine.pin_prefix(ids)
        except ValueError as err:  # (the engine names it `prefix`)
            raise ValueError(f"{field}: {err}") from err
    return engine, text


def _check_prefix_list(prefixes: Any) -> list:
    """`pinned_prefixes` as a list: a list or tuple of prefixes, each a text or a token id list
    (a bare text or token id list is refused, not read as many one-item prefixes)."""
    if isinstance(prefixes, (list, tuple)) and not any(isinstance(p, int) for p in prefixes):
        return list(prefixes)
    hint = f"; to pin it as one prefix, pass [{show(prefixes)}]" if isinstance(prefixes, (str, list, tuple)) else ""
    raise TypeError(f"pinned_prefixes: must be a list of prefixes (texts or token id lists), got "
                    f"{type(prefixes).__name__} {show(prefixes)}{hint}")
