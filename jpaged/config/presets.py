"""Model architecture specs: the decoder families of the paper (OPT, LLaMA) and tiny test configs.

A `ModelSpec` is pure data (no jax): the simulator and memory planning read parameter and
KV-cache sizes from it without building a model. Sizes of the real presets follow the published
Hugging Face configs of facebook/opt-*, the LLaMA-1 paper and meta-llama/Llama-3.x.
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
class RopeScaling:
    """Stretching RoPE to longer contexts (Hugging Face `rope_scaling` / `rope_parameters`).

    "linear" divides every frequency by `factor`. "llama3" (Llama 3.1+) divides only the low
    frequencies, whose wavelength exceeds `original_max_position_embeddings / low_freq_factor`,
    keeps the high ones (wavelength below `.. / high_freq_factor`) and blends in between.
    """

    rope_type: Literal["linear", "llama3"]
    factor: float  # how much longer the context is than the one the model was pre-trained on
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only: the pre-training context

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.rope_type must be 'linear' or 'llama3', got {self.rope_type!r}")
        if self.factor < 1.0:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if self.rope_type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                             f"high_freq_factor ({self.high_freq_factor})")


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
    rope_scaling: RopeScaling | None = None  # LLaMA only: long-context RoPE (Llama 3.1's "llama3")

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> ModelSpec:
        """The inverse of `dataclasses.asdict` (checkpoint metadata); fields added later take defaults."""
        fields = dict(fields)
        if fields.get("rope_scaling") is not None:
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**fields)

    def __post_init__(self) -> None:
        if self.family not in ("opt", "llama"):
            raise ValueError(f"family must be 'opt' or 'llama', got {self.family!r}")
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
        for field in ("norm_eps", "rope_theta"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (np.isfinite(value) and value > 0):
                raise ValueError(f"{field} must be a finite number > 0, got {value!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.family == "opt" and (self.num_kv_heads != self.num_heads
                                     or self.num_heads * self.head_dim != self.hidden_size):
            raise ValueError("opt family needs num_kv_heads == num_heads and "
                             "num_heads * head_dim == hidden_size")
        if self.family == "llama" and self.head_dim % 2:
            raise ValueError(f"llama family needs an even head_dim for RoPE, got {self.head_dim}")
        if self.family == "opt" and self.rope_scaling is not None:
            raise ValueError("opt family has learned positions: rope_scaling must be None")

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
           tie: bool = False, eps: float = 1e-6, theta: float = 10000.0,
           scaling: RopeScaling | None = None) -> ModelSpec:
    return ModelSpec(name=name, family="llama", vocab_size=vocab, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
                     intermediate_size=intermediate, max_position_embeddings=max_pos,
                     norm_eps=eps, rope_theta=theta, tie_word_embeddings=tie, rope_scaling=scaling)


def _llama3(name: str, hidden: int, layers: int, heads: int, intermediate: int, *, tie: bool = False,
            factor: float = 8.0) -> ModelSpec:
    """Llama 3.1 / 3.2: 8 KV heads, 128K vocabulary and context, theta 500K, "llama3" RoPE scaling."""
    return _llama(name, hidden, layers, heads, 8, intermediate, vocab=128256, max_pos=131072, tie=tie, eps=1e-5,
                  theta=500000.0, scaling=RopeScaling("llama3", factor, 1.0, 4.0, 8192))


_PRESETS: dict[str, ModelSpec] = {spec.name: spec for spec in (
    _opt("opt-125m", 768, 12, 12),
    _opt("opt-1.3b", 2048, 24, 32),
    _opt("opt-6.7b", 4096, 32, 32),
    _opt("opt-13b", 5120, 40, 40),
    _opt("opt-66b", 9216, 64, 72),
    _opt("opt-175b", 12288, 96, 96),
    _llama("llama-7b", 4096, 32, 32, 32, 11008),
    _llama("llama-13b", 5120, 40, 40, 40, 13824),
    _llama3("llama-3.2-1b", 2048, 16, 32, 8192, tie=True, factor=32.0),
    _llama3("llama-3.1-8b", 4096, 32, 32, 14336),
    _llama3("llama-3.1-70b", 8192, 80, 64, 28672),
    # Tiny configs for tests: a few layers, small vocab; tiny-llama uses GQA (4 q heads / 2 kv heads).
    _opt("tiny-opt", 64, 2, 4, vocab=256, max_pos=512),
    _llama("tiny-llama", 64, 2, 4, 2, 128, vocab=256, max_pos=512, head_dim=16),
    # The trained copy-task model (experiments.lm.tiny_task, assets/tiny-copy).
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
