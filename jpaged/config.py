"""Frozen configuration dataclasses, one per concern, and strict YAML loading.

Every field has a one-line comment; `__post_init__` validates ranges and raises `ValueError`
naming the field. `load_config(path, cls)` builds a (nested) dataclass from YAML: unknown keys and
wrong types are errors that name the key and the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from jpaged.models.presets import get_preset, preset_names
from pallas_kernels.backends import BACKEND_NAMES, BackendName

T = TypeVar("T")


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and pool sizes (device and host swap space)."""

    block_size: int = 16  # tokens per KV block (paper default 16)
    num_blocks: int = 984  # device blocks incl. reserved block 0 (OPT-13B/A100-40GB: 15,728 slots / 16 + 1)
    num_host_blocks: int = 984  # host (CPU) swap blocks; 0 disables swap; paper: <= device blocks
    watermark: float = 0.01  # fraction of device blocks kept free at admission, to avoid instant preemption
    enable_prefix_caching: bool = False  # share full prompt blocks across requests through a radix tree

    def __post_init__(self) -> None:
        _check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
               "cache.block_size", f"must be a power of two >= 1, got {self.block_size}")
        _check(self.num_blocks >= 2, "cache.num_blocks",
               f"must be >= 2 (block 0 is reserved), got {self.num_blocks}")
        _check(self.num_host_blocks >= 0, "cache.num_host_blocks", f"must be >= 0, got {self.num_host_blocks}")
        _check(0.0 <= self.watermark < 1.0, "cache.watermark", f"must be in [0, 1), got {self.watermark}")

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (block 0 is the padding target)."""
        return self.num_blocks - 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling: the step's token and sequence budgets, the policy, preemption."""

    max_num_seqs: int = 256  # most sequences in one step's batch (a request counts at its width n)
    max_num_batched_tokens: int = 2048  # token budget of one step (prompt chunks + decodes)
    max_model_len: int = 2048  # longest prompt + output a request may reach (OPT: 2048)
    preemption_mode: Literal["swap", "recompute"] = "recompute"  # recovery when blocks run out
    # paper: the paper's vLLM (whole prompts; a step that admits runs only prompts); chunked: decodes
    # first, prompt chunks fill the rest of the token budget (vLLM v1, Sarathi-Serve)
    policy: Literal["paper", "chunked"] = "chunked"
    long_prefill_token_threshold: int = 0  # chunked: most prompt tokens one sequence computes per step; 0 = no cap

    def __post_init__(self) -> None:
        _check(self.max_num_seqs >= 1, "scheduler.max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_model_len >= 1, "scheduler.max_model_len", f"must be >= 1, got {self.max_model_len}")
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "scheduler.max_num_batched_tokens",
               f"must be >= scheduler.max_num_seqs ({self.max_num_seqs}) so every running sequence's token "
               f"fits a step, got {self.max_num_batched_tokens}")
        _check(self.preemption_mode in ("swap", "recompute"), "scheduler.preemption_mode",
               f"must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        _check(self.policy in ("paper", "chunked"), "scheduler.policy",
               f"must be 'paper' or 'chunked', got {self.policy!r}")
        _check(self.long_prefill_token_threshold >= 0, "scheduler.long_prefill_token_threshold",
               f"must be >= 0 (0 = no cap), got {self.long_prefill_token_threshold}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how to run it."""

    name: str = "tiny-opt"  # preset name (jpaged.models.presets), e.g. opt-13b, llama-7b, tiny-llama
    # Parameter and KV cache dtype; auto: bfloat16 on GPU/TPU, float32 on CPU (jpaged.checkpoint.resolve_dtype).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: BackendName = "auto"  # pallas_kernels.backends; auto: Pallas on GPU, XLA on CPU
    checkpoint: str | None = None  # local orbax checkpoint or Hugging Face dir; None = dummy (seeded) weights
    seed: int = 0  # seed of dummy weights
    tensor_parallel_size: int = 1  # devices splitting every layer Megatron-style (heads, MLP columns/rows)
    coordinator_address: str | None = None  # multi-host: "host:port" of process 0 (jax.distributed)
    num_processes: int = 1  # multi-host: processes, one per host; 1 = single host
    process_id: int = 0  # multi-host: this process's rank in [0, num_processes)

    def __post_init__(self) -> None:
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "model.dtype",
               f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _check(self.attention_backend in BACKEND_NAMES, "model.attention_backend",
               f"must be one of {list(BACKEND_NAMES)}, got {self.attention_backend!r}")
        _check(self.tensor_parallel_size >= 1, "model.tensor_parallel_size",
               f"must be >= 1, got {self.tensor_parallel_size}")
        if self.name in preset_names():  # other names are checked once the checkpoint's spec is read
            try:
                get_preset(self.name).check_tensor_parallel(self.tensor_parallel_size)
            except ValueError as exc:
                raise ValueError(f"model.tensor_parallel_size: {exc}") from None
        _check(self.num_processes >= 1, "model.num_processes", f"must be >= 1, got {self.num_processes}")
        _check(0 <= self.process_id < self.num_processes, "model.process_id",
               f"must be in [0, {self.num_processes}), got {self.process_id}")
        _check(self.num_processes == 1 or self.coordinator_address is not None, "model.coordinator_address",
               f"is required when num_processes is {self.num_processes}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine is built from."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    executor: Literal["jax", "sim"] = "jax"  # jax: real model; sim: cost model on a virtual clock

    def __post_init__(self) -> None:
        _check(self.executor in ("jax", "sim"), "executor", f"must be 'jax' or 'sim', got {self.executor!r}")
        max_blocks = -(-self.scheduler.max_model_len // self.cache.block_size)
        _check(max_blocks >= 1, "scheduler.max_model_len", "must cover at least one block")


# ---------------------------------------------------------------------------------------------
# YAML loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Checks `value` against the annotation `tp` and converts nested dataclasses."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{source}: {key} must be a mapping, got {type(value).__name__}")
        return _build(tp, value, source, prefix=f"{key}.")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"{source}: {key} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in typing.get_args(tp):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arm, key, source)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise TypeError(f"{source}: {key} has the wrong type: {'; '.join(errors) or type(value).__name__}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{source}: {key} must be a list, got {type(value).__name__}")
        args = typing.get_args(tp)
        item_type = args[0] if args else Any
        items = [_coerce(v, item_type, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{source}: {key} must be a mapping, got {type(value).__name__}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        raise TypeError(f"{source}: {key} must be {_type_name(tp)}, got bool")
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} ({value!r})")
    return value


def _build(cls: type[T], data: dict, source: str, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(prefix + k for k in unknown)}; "
                         f"allowed: {', '.join(sorted(fields))}")
    kwargs = {name: _coerce(value, hints[name], prefix + name, source) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc


def config_from_dict(cls: type[T], data: dict, source: str = "<dict>") -> T:
    """Builds dataclass `cls` from a plain mapping with the same strict checks as `load_config`."""
    return _build(cls, data or {}, source)


def load_config(path: str | Path, cls: type[T]) -> T:
    """Loads YAML at `path` into dataclass `cls`; unknown keys and wrong types raise, naming key and file."""
    path = Path(path)
    with path.open() as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise TypeError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return _build(cls, data, str(path))


def config_to_dict(config: Any) -> dict:
    """A plain, YAML/JSON-ready dict of a (nested) config dataclass."""
    return dataclasses.asdict(config)
