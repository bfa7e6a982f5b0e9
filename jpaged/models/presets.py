"""Model architecture specs: the decoder families of the paper (OPT, LLaMA) and tiny test configs.

A `ModelSpec` is pure data (no jax): the simulator and memory planning read parameter and
KV-cache sizes from it without building a model. Sizes of the real presets follow the published
Hugging Face configs of facebook/opt-* and the LLaMA-1 paper.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

# OPT's learned position table has 2 extra leading rows (a fairseq padding convention that the
# Hugging Face weights keep): position p reads row p + 2.
OPT_POSITION_OFFSET = 2

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of `dtype` given as a name ("float16") or a numpy/jax dtype."""
    if isinstance(dtype, str):
        if dtype not in _ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {dtype!r}")
        return _ITEMSIZE[dtype]
    return np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Architecture of one decoder-only transformer; everything needed to build and size it."""

    name: str  # preset name, e.g. "opt-13b"
    family: Literal["opt", "llama"]  # opt: learned positions, LayerNorm, ReLU MLP; llama: RoPE, RMSNorm, SwiGLU
    vocab_size: int  # rows of the token embedding (and columns of the LM head)
    hidden_size: int  # residual stream width
    num_layers: int  # decoder blocks
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (== num_heads for MHA; fewer for GQA)
    head_dim: int  # width of one attention head
    intermediate_size: int  # MLP hidden width (OPT ffn_dim; LLaMA SwiGLU width)
    max_position_embeddings: int  # longest sequence (OPT: rows of the learned position table, less the offset)
    norm_eps: float = 1e-5  # LayerNorm (OPT) / RMSNorm (LLaMA) epsilon
    rope_theta: float = 10000.0  # RoPE base (LLaMA only)
    tie_word_embeddings: bool = True  # LM head shares the token embedding matrix

    def __post_init__(self) -> None:
        if self.family not in ("opt", "llama"):
            raise ValueError(f"family must be 'opt' or 'llama', got {self.family!r}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.family == "opt" and (self.num_kv_heads != self.num_heads
                                     or self.num_heads * self.head_dim != self.hidden_size):
            raise ValueError("opt family needs num_kv_heads == num_heads and "
                             "num_heads * head_dim == hidden_size")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"llama family needs an even head_dim for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Number of parameters (tied LM head counted once)."""
        h, v, f = self.hidden_size, self.vocab_size, self.intermediate_size
        if self.family == "opt":
            # q, k, v, out projections with biases; fc1, fc2 with biases; two LayerNorms (scale + bias).
            per_layer = 4 * (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
            embeddings = v * h + (self.max_position_embeddings + OPT_POSITION_OFFSET) * h
            final_norm = 2 * h
        else:
            # q, k, v, o without biases; gate, up, down; two RMSNorm scales.
            per_layer = 2 * h * self.q_size + 2 * h * self.kv_size + 3 * h * f + 2 * h
            embeddings = v * h
            final_norm = h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return embeddings + self.num_layers * per_layer + final_norm + lm_head

    def param_bytes(self, dtype: Any = "float16") -> int:
        """Bytes of all parameters stored in `dtype`."""
        return self.num_params() * dtype_itemsize(dtype)

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ValueError, naming the numbers, unless `tp` devices can split this model Megatron-style.

        Query heads and the MLP width must divide by `tp`. KV heads must divide by `tp`, or `tp` by
        them: with fewer KV heads than devices (GQA) each KV head is replicated on
        `tp // num_kv_heads` devices, as vLLM does, so every device holds the KV head its queries read.
        """
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.num_heads % tp:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not divisible by tensor_parallel_size {tp}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_kv_heads {self.num_kv_heads} and tensor_parallel_size {tp} must "
                             "divide one another (KV heads are split, or replicated when fewer than devices)")
        if self.intermediate_size % tp:
            raise ValueError(f"{self.name}: intermediate_size {self.intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp}")

    def kv_bytes_per_token(self, dtype: Any = "float16") -> int:
        """KV-cache bytes one token occupies: 2 (K, V) x layers x kv_heads x head_dim x itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_itemsize(dtype)


def _opt(name: str, hidden: int, layers: int, heads: int, *, vocab: int = 50272,
         max_pos: int = 2048) -> ModelSpec:
    return ModelSpec(name=name, family="opt", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                     intermediate_size=4 * hidden, max_position_embeddings=max_pos,
                     norm_eps=1e-5, tie_word_embeddings=True)


def _llama(name: str, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, *,
           vocab: int = 32000, max_pos: int = 2048, head_dim: int | None = None,
           tie: bool = False) -> ModelSpec:
    return ModelSpec(name=name, family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
                     intermediate_size=intermediate, max_position_embeddings=max_pos,
                     norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie)


_PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _opt("opt-125m", 768, 12, 12),
    _opt("opt-1.3b", 2048, 24, 32),
    _opt("opt-6.7b", 4096, 32, 32),
    _opt("opt-13b", 5120, 40, 40),
    _opt("opt-66b", 9216, 64, 72),
    _opt("opt-175b", 12288, 96, 96),
    _llama("llama-7b", 4096, 32, 32, 32, 11008),
    _llama("llama-13b", 5120, 40, 40, 40, 13824),
    # Tiny configs for tests: a few layers, small vocab; tiny-llama uses GQA (4 q heads / 2 kv heads).
    _opt("tiny-opt", 64, 2, 4, vocab=256, max_pos=512),
    _llama("tiny-llama", 64, 2, 4, 2, 128, vocab=256, max_pos=512, head_dim=16),
    # The trained copy-task model (jpaged.models.tiny_task, assets/tiny-copy).
    _llama("tiny-copy", 128, 2, 4, 2, 256, vocab=512, max_pos=1024, head_dim=32),
)}


def preset_names() -> list[str]:
    """Names accepted by `get_preset`."""
    return list(_PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The `ModelSpec` of preset `name`; ValueError listing the valid names otherwise."""
    if name not in _PRESETS:
        raise ValueError(f"model name must be one of {', '.join(_PRESETS)}; got {name!r}")
    return _PRESETS[name]
