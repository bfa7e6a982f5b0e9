"""jpaged: PagedAttention (Kwon et al., SOSP'23) in JAX — paged KV cache, Pallas kernels, serving engine.

The offline text API: `from jpaged import LLM, SamplingParams, StructuredOutputsParams` (imported
lazily: `import jpaged` alone pulls in no jax).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "AsyncLLMEngine", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from jpaged.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from jpaged.core.sequence import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from jpaged.core.constraints import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "AsyncLLMEngine":
        from jpaged.entrypoints.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(f"module 'jpaged' has no attribute {name!r}")
