"""Request fields jpaged accepts only at their neutral value, and the sampling controls' mapping.

OpenAI's and vLLM's clients send fields jpaged does not implement, mostly at values that ask for
nothing (`store: false`, `repetition_penalty: 1.0`, `service_tier: "auto"`). Such a
request is served; the same field at any other value is refused with a 400 naming it and saying
why, so no request is silently served differently from what it asked. docs/notes/serving.md has
the whole table (honoured / neutral-only / refused) with each reason.

`NEUTRAL_ONLY` holds the fields jpaged does not implement (yet), `CHAT_NEUTRAL_ONLY` those only
the chat route lacks; `CONTROLS` maps the sampling controls, which SamplingParams has under
vLLM's names, from the request onto SamplingParams.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from jpaged.entrypoints.serve.errors import RequestError


@dataclasses.dataclass(frozen=True)
class Neutral:
    """A field accepted only at `values` (compared with ==; a field left out is always neutral)."""

    values: tuple  # what the field may be
    reason: str  # why any other value is refused


_NO_TOOLS = "tool and function calls are not supported (no tool-call parser): only 'none'"

# field -> its neutral values and the reason others are refused. Fields of both routes unless
# the route's model lacks them (`check_neutral` looks only at the fields a model has).
NEUTRAL_ONLY: dict[str, Neutral] = {
    # Not planned: each needs a part jpaged does not have.
    "suffix": Neutral((None, ""), "insertion (text after the completion) is not supported"),
    "prompt_embeds": Neutral((None,), "embedding inputs are not supported: send text or token ids"),
    "logprob_token_ids": Neutral((None, []), "log-probabilities of chosen token ids are not supported: use logprobs"),
    "spaces_between_special_tokens": Neutral((True,), "the tokenizer's decoder alone places special tokens"),
    "priority": Neutral((0,), "the scheduler is first-come first-served (no priority scheduling)"),
    "watermarking": Neutral((None, False), "watermarking is not supported"),
    "kv_transfer_params": Neutral((None, {}), "disaggregated serving (KV transfer) is not supported"),
    "ec_transfer_params": Neutral((None, {}), "disaggregated serving (encoder cache transfer) is not supported"),
    "vllm_xargs": Neutral((None, {}), "no custom extensions are installed"),
    "repetition_detection": Neutral((None,), "n-gram repetition detection is not supported"),
    "thinking_token_budget": Neutral((None, -1), "no reasoning model is served (no thinking budget)"),
    "routed_experts_prompt_start": Neutral((0,), "no mixture-of-experts model is served (no routing data)"),
    "media_io_kwargs": Neutral((None, {}), "the models are text-only"),
    "mm_processor_kwargs": Neutral((None, {}), "the models are text-only"),
    "chat_template": Neutral((None,), "a chat template from the request is not trusted (vLLM refuses it too by "
                                      "default): the model's template is used"),
    # OpenAI's chat fields for features outside a local text model.
    "audio": Neutral((None,), "audio output is not supported"),
    "modalities": Neutral((None, ["text"]), "only text output is supported"),
    "prediction": Neutral((None,), "predicted outputs are not supported"),
    "moderation": Neutral((None,), "moderation is not supported"),
    "web_search_options": Neutral((None,), "web search is not supported"),
    "prompt_cache_options": Neutral((None,), "the prefix cache is configured by the server (--enable-prefix-caching)"),
    "prompt_cache_retention": Neutral((None, "in_memory"), "the prefix cache lives in memory only"),
    "store": Neutral((None, False), "this server stores no completions"),
    "service_tier": Neutral((None, "auto", "default"), "this server has one service tier"),
    "verbosity": Neutral((None, "medium"), "no reasoning model is served"),
    "functions": Neutral((None, []), _NO_TOOLS),
    "function_call": Neutral((None, "none"), _NO_TOOLS),
    # SGLang's extensions (its router and vllm-router send them, neutral, with every request)
    "no_stop_trim": Neutral((False,), "stop strings are trimmed from the output: use include_stop_str_in_output"),
    "return_hidden_states": Neutral((False,), "hidden states are not returned"),
}

# Neutral only on the chat route: completions honour their `echo` (the prompt before the completion).
CHAT_NEUTRAL_ONLY: dict[str, Neutral] = {
    "echo": Neutral((False, None), "vLLM's chat echo (the last message's content before the reply) is not "
                                   "supported: /v1/completions' echo is"),
}


def check_neutral(body: Any, rules: dict[str, Neutral] = NEUTRAL_ONLY) -> None:
    """RequestError naming the first field of `rules` that `body` sets to a value not neutral."""
    fields = type(body).model_fields
    for name in body.model_fields_set:
        rule = rules.get(name)
        if rule is not None and name in fields and getattr(body, name) not in rule.values:
            allowed = " or ".join(json.dumps(v) for v in rule.values)
            raise RequestError(f"{name}: {rule.reason}; accepted only as {allowed}", name)


@dataclasses.dataclass(frozen=True)
class Control:
    """A sampling control: when a request value asks for nothing, and how SamplingParams takes it."""

    is_neutral: Callable[[Any, Any], bool]  # (value, request) -> True when it changes nothing
    convert: Callable[[Any], Any] = lambda value: value  # request value -> SamplingParams value


# The sampling controls, by vLLM's name (the request field and the SamplingParams field alike).
# SamplingParams checks their ranges again and the engine's door their token ids (vocabulary).
CONTROLS: dict[str, Control] = {
    "presence_penalty": Control(lambda v, _: v == 0.0),
    "frequency_penalty": Control(lambda v, _: v == 0.0),
    "repetition_penalty": Control(lambda v, _: v == 1.0),
    "logit_bias": Control(lambda v, _: not v, lambda v: {int(k): float(b) for k, b in v.items()}),
    "min_tokens": Control(lambda v, _: v == 0),
    "min_p": Control(lambda v, _: v == 0.0),
    "allowed_token_ids": Control(lambda v, _: False, tuple),
    "bad_words": Control(lambda v, _: not v, tuple),  # the text front end turns them into token ids
    "best_of": Control(lambda v, request: v == request.n),
}


def sampling_controls(body: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments for the controls `body` sets to something not neutral
    (left out at their neutral values, so SamplingParams keeps its own defaults)."""
    controls = {}
    fields = type(body).model_fields
    for name, control in CONTROLS.items():
        value = getattr(body, name) if name in fields else None
        if value is None or control.is_neutral(value, body):
            continue
        controls[name] = control.convert(value)
    return controls
