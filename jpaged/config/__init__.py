"""Frozen configuration dataclasses, one per concern, and strict YAML loading.

Every field is documented by the string right after it (an attribute docstring, as vLLM's configs;
`jpaged.config.docs.attribute_docs` reads them, e.g. for `jpaged serve --help`); `__post_init__` checks every field's type and range
(`jpaged.config.checks`): TypeError or ValueError naming the field, the value and the range.
`load_config(path, cls)` (jpaged.config.loading) builds a (nested) dataclass from YAML: unknown keys,
duplicate keys, wrong types and NaN are errors that name the key and the file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

from jpaged.config.checks import INT32_LIMIT, UINT32_LIMIT, check_bool, check_choice, check_float, check_int, check_str
from jpaged.config.loading import config_from_dict, config_to_dict, load_config
from jpaged.config.presets import get_preset, preset_names
from pallas_kernels.backend_names import BACKEND_NAMES, BackendName

__all__ = ["CacheConfig", "SchedulerConfig", "ModelConfig", "SpeculativeConfig", "EngineConfig", "load_config",
           "config_from_dict", "config_to_dict"]


# Upper bounds of the sizes: far above any real deployment, low enough that a typo (1e20) is an
# error naming the field rather than a numpy allocation failure.
MAX_BLOCK_SIZE = 2**16  # tokens per block
MAX_BLOCKS = 2**24  # device or host blocks (the free lists are Python lists)
MAX_NUM_SEQS = 2**16  # block-table rows
MAX_TOKENS = 2**24  # max_model_len, token budgets (positions are int32)
MAX_TABLE_ENTRIES = 2**28  # block-table entries: rows x blocks per sequence
# The simulator's device pool when cache.num_blocks is None (it has no memory to size one from):
# OPT-13B on an A100-40GB, the paper's set-up (15,728 slots / 16 + block 0).
SIM_NUM_BLOCKS = 984


def _check(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {message}")


def _normalise(config: Any, prefix: str, checks: dict[str, Callable[[str, Any], Any]]) -> None:
    """Runs each field's check (`jpaged.config.checks`) and stores the normalised value on the frozen
    dataclass: the wrong type is a TypeError, a value out of range a ValueError, naming the field."""
    for name, check in checks.items():
        object.__setattr__(config, name, check(f"{prefix}.{name}", getattr(config, name)))


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, pool sizes (device; host: swap space and the prefix
    cache's host tier, one pool), prefix caching and its eviction policy."""

    block_size: int = 16
    """Tokens per KV block, a power of two (paper default 16)."""
    num_blocks: int | None = None
    """Device blocks incl. reserved block 0. None: sized from memory where the real executor is built,
    after the weights load (jpaged.executors.kv_sizing: kv_cache_memory_bytes, else
    gpu_memory_utilization); the simulator takes SIM_NUM_BLOCKS. Given, it wins over both."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory (on CPU: of free host memory) the weights, the largest step's
    activations and the KV pool may take together; the pool gets the rest (vLLM's
    --gpu-memory-utilization)."""
    kv_cache_memory_bytes: int | None = None
    """KV pool bytes per device, instead of gpu_memory_utilization."""
    num_host_blocks: int = 984
    """Host (CPU) swap blocks; 0 disables swap (swap-outs take no host-tier block either); paper:
    <= device blocks."""
    watermark: float = 0.01
    """Fraction of device blocks kept free at admission, to avoid instant preemption."""
    enable_prefix_caching: bool = False
    """Share full prompt blocks across requests through a radix tree."""
    num_host_cache_blocks: int = 0
    """Host blocks added to the host pool for the prefix cache's second tier: evicted cached blocks
    are copied there, and hits promote them back; 0 = no tier (evicted blocks are dropped)."""
    eviction_policy: Literal["lru", "arc"] = "lru"
    """Eviction order of both prefix-cache tiers: lru (least recently released) or arc (adaptive
    replacement: recency vs reuse, jpaged.core.kv.eviction)."""

    def __post_init__(self) -> None:
        _normalise(self, "cache", {
            "block_size": lambda f, v: check_int(f, v, 1, MAX_BLOCK_SIZE),
            "num_blocks": lambda f, v: None if v is None else check_int(f, v, 2, MAX_BLOCKS),
            "gpu_memory_utilization": lambda f, v: check_float(f, v, 0.0, 1.0, lo_open=True),
            "kv_cache_memory_bytes": lambda f, v: None if v is None else check_int(f, v, 1),
            "num_host_blocks": lambda f, v: check_int(f, v, 0, MAX_BLOCKS),
            "watermark": lambda f, v: check_float(f, v, 0.0, 1.0, hi_open=True),
            "enable_prefix_caching": check_bool,
            "num_host_cache_blocks": lambda f, v: check_int(f, v, 0, MAX_BLOCKS),
            "eviction_policy": lambda f, v: check_choice(f, v, ("lru", "arc")),
        })
        _check(self.block_size & (self.block_size - 1) == 0, "cache.block_size",
               f"must be a power of two in [1, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.num_blocks is not None:
            _check(self.num_blocks * self.block_size < INT32_LIMIT, "cache.num_blocks",
                   f"num_blocks x block_size = {self.num_blocks * self.block_size} slots must be < 2**31 "
                   f"(slot ids are int32), got num_blocks={self.num_blocks}")
        _check(self.num_host_cache_blocks == 0 or self.enable_prefix_caching, "cache.num_host_cache_blocks",
               f"a host tier ({self.num_host_cache_blocks} blocks) caches prefix blocks: it needs "
               f"cache.enable_prefix_caching: true (or num_host_cache_blocks: 0)")
        _check(self.num_host_blocks + self.num_host_cache_blocks <= MAX_BLOCKS, "cache.num_host_cache_blocks",
               f"num_host_blocks + num_host_cache_blocks = {self.num_host_blocks + self.num_host_cache_blocks} "
               f"host blocks, more than {MAX_BLOCKS}")

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (block 0 is the padding target)."""
        return self.sized_num_blocks - 1

    @property
    def sized_num_blocks(self) -> int:
        """num_blocks, which must be known by now: ValueError while it is still to be sized from memory."""
        _check(self.num_blocks is not None, "cache.num_blocks",
               "None (size from memory) is resolved where the real executor is built (LLMEngine, LLM, "
               "jpaged serve); here a block count is needed")
        return self.num_blocks


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling: the step's token and sequence budgets, the policy, preemption."""

    max_num_seqs: int = 256
    """Most sequences in one step's batch (a request counts at its width n)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prompt chunks + decodes)."""
    max_model_len: int = 2048
    """Longest prompt + output a request may reach (OPT: 2048)."""
    preemption_mode: Literal["swap", "recompute"] = "recompute"
    """Recovery when blocks run out: swap to host blocks, or free and recompute."""
    policy: Literal["paper", "chunked"] = "chunked"
    """paper: the paper's vLLM (whole prompts; a step that admits runs only prompts); chunked: decodes
    first, prompt chunks fill the rest of the token budget (vLLM v1, Sarathi-Serve)."""
    long_prefill_token_threshold: int = 0
    """chunked: most prompt tokens one sequence computes per step; 0 = no cap."""
    async_scheduling: bool = False
    """Schedule and launch the next decode step before applying this one's tokens (vLLM's
    --async-scheduling): the host's work hides behind the device's; outputs are unchanged."""

    def __post_init__(self) -> None:
        _normalise(self, "scheduler", {
            "max_num_seqs": lambda f, v: check_int(f, v, 1, MAX_NUM_SEQS),
            "max_num_batched_tokens": lambda f, v: check_int(f, v, 1, MAX_TOKENS),
            "max_model_len": lambda f, v: check_int(f, v, 1, MAX_TOKENS),
            "preemption_mode": lambda f, v: check_choice(f, v, ("swap", "recompute")),
            "policy": lambda f, v: check_choice(f, v, ("paper", "chunked")),
            "long_prefill_token_threshold": lambda f, v: check_int(f, v, 0, MAX_TOKENS),
            "async_scheduling": check_bool,
        })
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "scheduler.max_num_batched_tokens",
               f"must be >= scheduler.max_num_seqs ({self.max_num_seqs}) so every running sequence's token "
               f"fits a step, got {self.max_num_batched_tokens}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to serve and how to run it."""

    name: str = "tiny-opt"
    """Preset name (jpaged.config.presets), e.g. opt-13b, llama-7b, tiny-llama."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter and KV cache dtype; auto: bfloat16 on GPU/TPU, float32 on CPU
    (jpaged.models.checkpoint.resolve_dtype)."""
    attention_backend: BackendName = "auto"
    """Attention kernels (pallas_kernels.backends); auto: Pallas on GPU, XLA on CPU."""
    checkpoint: str | None = None
    """Local orbax checkpoint or Hugging Face dir; None = dummy (seeded) weights."""
    seed: int = 0
    """Seed of the dummy weights."""
    tensor_parallel_size: int = 1
    """Devices splitting every layer Megatron-style (heads, MLP columns/rows), across processes too."""
    coordinator_address: str | None = None
    """Multi-host: "host:port" of process 0 (jax.distributed)."""
    num_processes: int = 1
    """Multi-host: processes, one per host; 1 = single host."""
    process_id: int = 0
    """Multi-host: this process's rank in [0, num_processes)."""

    def __post_init__(self) -> None:
        _normalise(self, "model", {
            "name": check_str,
            "dtype": lambda f, v: check_choice(f, v, ("auto", "float32", "bfloat16", "float16")),
            "attention_backend": lambda f, v: check_choice(f, v, BACKEND_NAMES),
            "checkpoint": lambda f, v: check_str(f, v, optional=True),
            "seed": lambda f, v: check_int(f, v, 0, UINT32_LIMIT, hi_open=True),
            "tensor_parallel_size": lambda f, v: check_int(f, v, 1),
            "coordinator_address": lambda f, v: check_str(f, v, optional=True),
            "num_processes": lambda f, v: check_int(f, v, 1),
            "process_id": lambda f, v: check_int(f, v, 0),
        })
        if self.name in preset_names():  # other names are checked once the checkpoint's spec is read
            try:
                get_preset(self.name).check_tensor_parallel(self.tensor_parallel_size)
            except ValueError as exc:
                raise ValueError(f"model.tensor_parallel_size: {exc}") from None
        _check(self.process_id < self.num_processes, "model.process_id",
               f"must be in [0, {self.num_processes}), got {self.process_id}")
        _check(self.num_processes == 1 or self.coordinator_address is not None, "model.coordinator_address",
               f"is required when num_processes is {self.num_processes}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# Most tokens one verify step drafts per sequence: its k + 1 logits rows per sequence must fit the
# sampler's rows (max_num_seqs), and acceptance falls geometrically with k.
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): a proposer drafts up to
    num_speculative_tokens tokens per decoding sequence, and the target model verifies them in one
    step (jpaged.core.sched.speculation). method None: off."""

    method: str | None = None
    """ngram: prompt lookup, the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min); draft_model:
    greedy decodes of a smaller model (`model`) sharing the target's vocabulary; None: off."""
    model: str | None = None
    """draft_model: the draft's local Hugging Face directory (as `LLM(model=...)` takes), run in
    the target's dtype and block size; required for draft_model, refused otherwise."""
    num_speculative_tokens: int = 0
    """k: tokens drafted per sequence and step, in [1, 16] when a method is set."""
    prompt_lookup_max: int | None = None
    """ngram: longest suffix matched; None: prompt_lookup_min, or 5 when both are None (vLLM's rule)."""
    prompt_lookup_min: int | None = None
    """ngram: shortest suffix matched; None: prompt_lookup_max, or 5 when both are None."""
    disable_by_batch_size: int | None = None
    """Steps with at least this many decoding sequences run without speculation (where verifying
    k + 1 tokens per sequence costs more than it saves); None: never disabled by size."""

    def __post_init__(self) -> None:
        _normalise(self, "speculative", {
            "method": lambda f, v: None if v is None else check_choice(f, v, SPECULATIVE_METHODS),
            "model": lambda f, v: check_str(f, v, optional=True),
            "num_speculative_tokens": lambda f, v: check_int(f, v, 0, MAX_SPECULATIVE_TOKENS),
            "prompt_lookup_max": lambda f, v: None if v is None else check_int(f, v, 1, MAX_TOKENS),
            "prompt_lookup_min": lambda f, v: None if v is None else check_int(f, v, 1, MAX_TOKENS),
            "disable_by_batch_size": lambda f, v: None if v is None else check_int(f, v, 1, MAX_NUM_SEQS),
        })
        _check((self.model is not None) == (self.method == "draft_model"), "speculative.model",
               f"a draft model's directory is required by method 'draft_model' and taken by no other, got "
               f"{self.model!r} with method {self.method!r}")
        if self.method is None:
            return
        _check(self.num_speculative_tokens >= 1, "speculative.num_speculative_tokens",
               f"must be in [1, {MAX_SPECULATIVE_TOKENS}] with method {self.method!r}, got {self.num_speculative_tokens}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)
        _check(self.prompt_lookup_min <= self.prompt_lookup_max, "speculative.prompt_lookup_min",
               f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")

    @property
    def enabled(self) -> bool:
        """True when a method is set."""
        return self.method is not None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything an LLMEngine is built from."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Which model and how to run it."""
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    """The paged KV cache."""
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    """Iteration-level scheduling."""
    executor: Literal["jax", "sim"] = "jax"
    """jax: the real model; sim: the cost model on a virtual clock (jpaged.paper)."""
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    """Speculative decoding (off by default)."""

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                          ("speculative", SpeculativeConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name}: must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        check_choice("executor", self.executor, ("jax", "sim"))
        if self.executor == "sim" and self.cache.num_blocks is None:  # no device memory to size from
            object.__setattr__(self, "cache", dataclasses.replace(self.cache, num_blocks=SIM_NUM_BLOCKS))
        entries = self.scheduler.max_num_seqs * -(-self.scheduler.max_model_len // self.cache.block_size)
        _check(entries <= MAX_TABLE_ENTRIES, "scheduler.max_num_seqs",
               f"max_num_seqs x ceil(max_model_len / block_size) = {entries} block-table entries, more than "
               f"{MAX_TABLE_ENTRIES} (1 GiB of int32): lower max_num_seqs or max_model_len, or raise block_size")
