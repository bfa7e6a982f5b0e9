"""The engine's door: every argument of a request checked before anything is queued.

`check_request` returns the request normalised (a list of Python ints, plain strs, max_tokens
clamped to what max_model_len leaves) or raises TypeError / ValueError naming the field, the value
and the allowed range. It changes nothing, so `LLMEngine.generate` checks all its requests before
it queues any. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Container, NamedTuple

from jpaged.config import SchedulerConfig, SpeculativeConfig
from jpaged.config.checks import check_float, check_str, check_token_ids, show
from jpaged.core.kv.kv_manager import KVCacheManager
from jpaged.core.kv.prefix_cache import NO_HIT
from jpaged.core.sequence import MAX_BANNED_IDS, SamplingParams


class CheckedRequest(NamedTuple):
    """A request that passed `check_request`, its fields normalised."""

    request_id: str
    prompt: list[int]
    params: SamplingParams  # max_tokens clamped to what max_model_len leaves
    arrival_time: float | None
    cache_salt: str | None


def check_request(request_id: Any, prompt_token_ids: Any, sampling_params: Any, arrival_time: Any,
                  cache_salt: Any, *,
                  scheduler: SchedulerConfig, kv: KVCacheManager, vocab_size: int | None, in_use: Container[str],
                  eos_token_ids: tuple[int, ...] = (), prompt_field: str = "prompt_token_ids",
                  params_field: str = "sampling_params", subject: str | None = None,
                  speculative: SpeculativeConfig | None = None) -> CheckedRequest:
    """Every argument of `LLMEngine.add_request` checked against its type and the engine's limits
    (`scheduler`, the pool of `kv`, the model's vocabulary, its `eos_token_ids`, `speculative`
    decoding; ids `in_use` are
    taken). Raises TypeError or ValueError naming the field (`prompt_field` / `params_field` as the
    caller calls them); errors about the prompt's length name it `subject` (default "request
    '<id>': prompt")."""
    request_id = check_str("request_id", request_id)
    if request_id in in_use:
        raise ValueError(f"request_id: {request_id!r} is already in use")
    if not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"{params_field}: must be a SamplingParams, got {type(sampling_params).__name__} "
                        f"{show(sampling_params)}")
    prompt = check_token_ids(prompt_field, prompt_token_ids, vocab_size)
    cache_salt = check_str("cache_salt", cache_salt, optional=True)
    if arrival_time is not None:
        arrival_time = check_float("arrival_time", arrival_time)
    subject = f"request {request_id!r}: prompt" if subject is None else subject
    if len(prompt) >= scheduler.max_model_len:
        raise ValueError(f"{subject} of {len(prompt)} tokens leaves no room to generate "
                         f"within max_model_len={scheduler.max_model_len}")
    if scheduler.policy == "paper" and len(prompt) > scheduler.max_num_batched_tokens:
        raise ValueError(f"{subject} of {len(prompt)} tokens exceeds "
                         f"max_num_batched_tokens={scheduler.max_num_batched_tokens} (policy 'paper' prefills "
                         f"whole prompts; policy 'chunked' splits them)")
    # The pinned blocks its cached prefix maps are shared, not its own (none for a prompt that
    # wants log-probabilities: it computes every position, as admission does).
    pinned = kv.num_pinned_blocks
    hits = kv.match_prefix(prompt, cache_salt) if pinned and sampling_params.prompt_logprobs is None else NO_HIT
    if not kv.fits(len(prompt) + 1, hits=hits):  # the prompt and its first token (outgrowing the pool later ends it)
        shared = kv.num_shared_pinned(hits)
        raise ValueError(f"{subject} of {len(prompt)} tokens needs {kv.rows.blocks_for(len(prompt) + 1)} KV blocks"
                         + (f" ({shared} of them pinned and shared)" if shared else "")
                         + f"; the pool has {kv.num_usable_blocks} (cache.num_blocks - 1)"
                         + (f", {pinned} of them held by pinned prefixes" if pinned else ""))
    if sampling_params.bad_words and not sampling_params.bad_words_token_ids:
        raise ValueError(f"{params_field}.bad_words: need a tokenizer (the text front end turns them into "
                         f"bad_words_token_ids); without one, give bad_words_token_ids")
    if sampling_params.structured_outputs is not None:
        raise ValueError(f"{params_field}.structured_outputs: need a tokenizer (the text front end compiles them "
                         f"into a constraint); without one, give a TokenConstraint as constraint")
    _check_banned(sampling_params, eos_token_ids, params_field)
    if sampling_params.use_beam_search and speculative is not None and speculative.enabled:
        raise ValueError(f"{params_field}.use_beam_search: not supported with speculative decoding "
                         f"(speculative.method={speculative.method!r}): beams rank every candidate of each step")
    n = sampling_params.n
    width, width_field = (n, "n") if sampling_params.best_of is None else (sampling_params.best_of, "best_of")
    if width > scheduler.max_num_seqs:
        raise ValueError(f"request {request_id!r}: {params_field}.{width_field}={width} exceeds "
                         f"scheduler.max_num_seqs={scheduler.max_num_seqs}: a request's sequences run in one batch")
    if vocab_size is not None:
        if sampling_params.use_beam_search and 2 * n > vocab_size:
            raise ValueError(f"request {request_id!r}: {params_field}.n={n} exceeds {vocab_size // 2}, the "
                             f"widest beam search the vocabulary of {vocab_size} allows (each beam ranks "
                             f"2 x width candidates)")
        _check_vocabulary(sampling_params, vocab_size, params_field)
    max_tokens = min(sampling_params.max_tokens, scheduler.max_model_len - len(prompt))
    # (min_tokens beyond what max_model_len leaves: the length limit comes first)
    params = dataclasses.replace(sampling_params, max_tokens=max_tokens,
                                 min_tokens=min(sampling_params.min_tokens, max_tokens))  # (re-runs the field checks)
    return CheckedRequest(request_id, prompt, params, arrival_time, cache_salt)


def _check_vocabulary(params: SamplingParams, vocab_size: int, field: str) -> None:
    """Every token id the sampling parameters name lies in the model's vocabulary."""
    check_token_ids(f"{field}.stop_token_ids", params.stop_token_ids, vocab_size, allow_empty=True)
    if params.logit_bias:
        check_token_ids(f"{field}.logit_bias keys", list(params.logit_bias), vocab_size)
    if params.allowed_token_ids is not None:
        check_token_ids(f"{field}.allowed_token_ids", params.allowed_token_ids, vocab_size)
    for i, word in enumerate(params.bad_words_token_ids):
        check_token_ids(f"{field}.bad_words_token_ids[{i}]", word, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):  # top candidates come from the vocabulary
        k = getattr(params, name)
        if k is not None and k > vocab_size:
            raise ValueError(f"{field}.{name}={k} exceeds the vocabulary of {vocab_size} tokens")
    if params.constraint is not None and params.constraint.vocab_size > vocab_size:
        raise ValueError(f"{field}.constraint.vocab_size: must be <= the model's vocabulary of {vocab_size} tokens, "
                         f"got {params.constraint.vocab_size}")


def _check_banned(params: SamplingParams, eos_token_ids: tuple[int, ...], field: str) -> None:
    """The ids one step may ban fit the sampler's fixed list width: one per bad word, and while
    min_tokens holds, every stop id and EOS id."""
    bad_words = len(params.bad_words_token_ids)
    stops = len(set(params.stop_token_ids) | set(eos_token_ids)) if params.min_tokens else 0
    if bad_words + stops > MAX_BANNED_IDS:
        raise ValueError(f"{field}: bad_words_token_ids ({bad_words} words) and, with min_tokens, stop_token_ids "
                         f"with the model's EOS ids ({stops} ids) would ban {bad_words + stops} ids in a step; at "
                         f"most {MAX_BANNED_IDS}")
