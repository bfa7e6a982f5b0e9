"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, text in, text out (vLLM's `LLM`).

    from jpaged import LLM, SamplingParams
    llm = LLM(model="assets/stdlib-lm", max_num_seqs=32)  # a preset name or a local HF directory
    out = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=32, stop=["\\n\\n"]))
    print(out[0].outputs[0].text)

Prompts are strings (encoded with the model's tokenizer) or token id lists. Outputs carry `text`,
`token_ids`, finish and stop reasons and, with `SamplingParams(logprobs=k)`, per-token
log-probabilities. Generation stops at the model's EOS ids (tokenizer + generation_config) unless
`ignore_eos`; stop strings end a sample in the engine as soon as its text contains one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from jpaged.config import EngineConfig
from jpaged.core.outputs import RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.engine_args import load_engine
from jpaged.executors.warmup import compile_grid, enable_compilation_cache
from jpaged.text.output_processor import prompt_ids
from jpaged.text.requests import TextRequest, TextRequests
from jpaged.text.tokenizer import Tokenizer

PromptLike = str | Sequence[int]


def _as_prompt_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
    """One prompt (a string or a list of ids) or a list of them -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError(f"prompts: must be a string, a list of token ids, or a list of those, got {type(prompts).__name__}")


class LLM:
    """An engine with its tokenizer, for offline batches of prompts."""

    def __init__(self, model: str, *, config: EngineConfig | str | Path | None = None,
                 tokenizer: str | None = None, warmup: bool = True, **engine_args: Any):
        """`model`: a preset name or a local HF directory; `config`: a base EngineConfig or its YAML;
        `tokenizer`: another local HF directory to take the tokenizer from; `warmup`: compile every
        step shape and sampler variant the config can produce now (jpaged.executors.warmup; False:
        each compiles on first use); `engine_args`: config fields by name (block_size, num_blocks,
        max_num_seqs, max_model_len, dtype, policy, ...; without num_blocks the KV pool is sized
        from gpu_memory_utilization or kv_cache_memory_bytes: jpaged.executors.kv_sizing) and
        `pinned_prefixes` (texts or token id lists pre-stored before serving: `pin_prefix`). Compiled programs are cached on disk
        under $JPAGED_CACHE_DIR (default ~/.cache/jpaged), so a second LLM of the same config
        compiles nothing."""
        self.model = model
        enable_compilation_cache()  # before the engine compiles anything
        self.engine, self.tokenizer = load_engine(model, config, tokenizer, **engine_args)
        self.warmup_report = compile_grid(self.engine.executor, self.engine.config) if warmup else None
        self._requests = TextRequests(self.engine, self.tokenizer)
        self._num_requests = 0

    def pin_prefix(self, prefix: PromptLike) -> int:
        """Pre-stores `prefix` (text, encoded as prompts are, or token ids) in the prefix cache,
        never evicted: prompts that start with it compute none of it (`LLMEngine.pin_prefix`;
        needs enable_prefix_caching). Returns the blocks pinned."""
        token_ids, _ = prompt_ids(prefix, self.tokenizer, "prefix")
        return self.engine.pin_prefix(token_ids)

    def get_tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a preset with dummy weights)."""
        return self.tokenizer

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serves every prompt to completion; one RequestOutput per prompt, in order.

        Every prompt is checked before any runs: a bad one raises (naming `prompts[i]`) and
        nothing is left queued. `sampling_params` is one for all prompts or one per prompt
        (default: SamplingParams(), greedy, 16 tokens); its output_kind is ignored (outputs are final).
        """
        items = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        encoded = [prompt_ids(p, self.tokenizer, f"prompts[{i}]") for i, p in enumerate(items)]
        ids = [f"llm-{self._num_requests + i}" for i in range(len(items))]
        self._num_requests += len(items)
        finals = [p if p.output_kind == "final" else dataclasses.replace(p, output_kind="final") for p in params]
        self._requests.add_all([TextRequest(request_id, token_ids, final, prompt=text)
                                for request_id, (token_ids, text), final in zip(ids, encoded, finals)])
        return self._run(ids, use_tqdm)

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates the assistant's reply to one conversation (a list of {"role", "content"}) or to
        several; the prompt is the model's chat template rendered as transformers renders it."""
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer with a chat template (this model has none)")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, chat_template=chat_template)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Steps the engine until every request of `ids` finished; stop strings end samples between steps."""
        requests = self._requests
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        start = time.perf_counter()
        num_tokens = 0
        while len(results) < len(ids) and requests.has_unfinished():
            for out in requests.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    num_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
            bar.set_postfix(output_tok_s=f"{num_tokens / max(time.perf_counter() - start, 1e-9):.0f}", refresh=False)
        bar.close()
        return [results[i] for i in ids]
