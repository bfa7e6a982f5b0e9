"""Bad input through every public entry, one row per case (issue 14): add_request, generate, abort,
SamplingParams, every config dataclass, YAML loading (and experiments' configs through it).

Each row asserts the exception type and that the message names the field (or the file) and the
value; then the engine, which had a request in flight while the bad input arrived, serves that
request and a new one exactly (the dense reference's greedy tokens) with no block leaked and
nothing of the bad call left queued.
"""

import dataclasses

import numpy as np
import pytest

from experiments.bench.bench_host import BenchHostConfig
from experiments.throughput import ThroughputConfig
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_from_dict, load_config
from jpaged.core.constraints import StructuredOutputsParams as SOP
from jpaged.core.sequence import SamplingParams as SP
from jpaged.engine import LLMEngine
from jpaged.paper.workloads import WorkloadConfig
from tests.helpers.constraints import DigitsThenEos
from tests.helpers.tiny_engines import dense_greedy, make_engine, run_to_end

GOOD_PROMPT = [5, 6, 7, 8]
GOOD_TOKENS = 4
VOCAB = 256  # tiny-opt


@pytest.fixture(scope="module")
def engine():
    # 12 usable blocks of 8 tokens; max_num_seqs above VOCAB / 2 so that the beam-width limit shows.
    return make_engine(num_blocks=13, max_num_seqs=200, prefix_caching=True)


@pytest.fixture(scope="module")
def reference():
    return dense_greedy("tiny-opt", [GOOD_PROMPT], GOOD_TOKENS)[0]


def yaml_row(case_id, text, cls, exc, *names):
    """A row that writes `text` to a YAML file and loads it as `cls` (the file's path is `{file}`)."""
    def load(engine, tmp_path):
        path = tmp_path / "bad.yaml"
        path.write_bytes(text.encode() if isinstance(text, str) else text)
        return load_config(path, cls)
    return row(case_id, load, exc, *names)


def paper_engine(engine):
    """An engine with policy paper and a 32-token budget beside `engine` (sharing its executor; never stepped)."""
    scheduler = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=32, max_model_len=128, policy="paper")
    return LLMEngine(dataclasses.replace(engine.config, scheduler=scheduler), executor=engine.executor)


def tiny_config(**cache):
    """tiny-opt on the JAX executor with the cache settings `cache` (a 1 TiB pool: no machine fits it)."""
    return EngineConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"),
                        cache=CacheConfig(**{"num_blocks": 8, "num_host_blocks": 0, **cache}))


def row(case_id, call, exc, *names):
    return pytest.param(call, exc, names, id=case_id)


NAN = float("nan")

# (engine, tmp_path) -> raises. `names` must all appear in the message; "{file}" is the YAML file.
CASES = [
    # ---- add_request: request_id
    row("request_id-int", lambda e, d: e.add_request(5, [1, 2], SP()), TypeError, "request_id", "int 5"),
    row("request_id-None", lambda e, d: e.add_request(None, [1, 2], SP()), TypeError, "request_id", "None"),
    row("request_id-list", lambda e, d: e.add_request(["a"], [1, 2], SP()), TypeError, "request_id", "list"),
    row("request_id-in-use", lambda e, d: e.add_request("bystander", [1, 2], SP()), ValueError,
        "request_id", "'bystander'", "already in use"),
    # ---- add_request: prompt_token_ids
    row("prompt-None", lambda e, d: e.add_request("x", None, SP()), TypeError, "prompt_token_ids", "NoneType"),
    row("prompt-str", lambda e, d: e.add_request("x", "hello", SP()), TypeError, "prompt_token_ids", "'hello'"),
    row("prompt-int", lambda e, d: e.add_request("x", 7, SP()), TypeError, "prompt_token_ids", "int 7"),
    row("prompt-dict", lambda e, d: e.add_request("x", {1: 2}, SP()), TypeError, "prompt_token_ids", "dict"),
    row("prompt-empty", lambda e, d: e.add_request("x", [], SP()), ValueError, "prompt_token_ids", "empty"),
    row("prompt-fractional", lambda e, d: e.add_request("x", [1.9, 2.2, 3.7], SP()), TypeError,
        "prompt_token_ids[0]", "1.9"),
    row("prompt-integral-floats", lambda e, d: e.add_request("x", [1, 2.0], SP()), TypeError,
        "prompt_token_ids[1]", "2.0"),
    row("prompt-nan-array", lambda e, d: e.add_request("x", np.array([1.0, NAN, 3.0]), SP()), TypeError,
        "prompt_token_ids", "float64"),
    row("prompt-integral-float-array", lambda e, d: e.add_request("x", np.array([1.0, 2.0]), SP()), TypeError,
        "prompt_token_ids", "float64"),
    row("prompt-bool-array", lambda e, d: e.add_request("x", np.array([True, False]), SP()), TypeError,
        "prompt_token_ids", "bool"),
    row("prompt-bools", lambda e, d: e.add_request("x", [True, False], SP()), TypeError,
        "prompt_token_ids[0]", "bool"),
    row("prompt-2d-array", lambda e, d: e.add_request("x", np.ones((2, 2), np.int32), SP()), TypeError,
        "prompt_token_ids", "(2, 2)"),
    row("prompt-0d-array", lambda e, d: e.add_request("x", np.array(3), SP()), TypeError, "prompt_token_ids", "()"),
    row("prompt-str-item", lambda e, d: e.add_request("x", [1, "2"], SP()), TypeError, "prompt_token_ids[1]", "'2'"),
    row("prompt-nested", lambda e, d: e.add_request("x", [[1, 2]], SP()), TypeError, "prompt_token_ids[0]", "list"),
    row("prompt-None-item", lambda e, d: e.add_request("x", [1, None], SP()), TypeError, "prompt_token_ids[1]", "None"),
    row("prompt-out-of-vocab", lambda e, d: e.add_request("x", [1, 999], SP()), ValueError,
        "prompt_token_ids[1]", "999", f"[0, {VOCAB})"),
    row("prompt-negative", lambda e, d: e.add_request("x", [-1, 2], SP()), ValueError, "prompt_token_ids[0]", "-1"),
    row("prompt-huge-id", lambda e, d: e.add_request("x", [2**70], SP()), ValueError,
        "prompt_token_ids[0]", str(2**70)),
    row("prompt-huge-id-uint64", lambda e, d: e.add_request("x", np.array([2**63], np.uint64), SP()), ValueError,
        "prompt_token_ids[0]", str(2**63)),
    row("prompt-too-long", lambda e, d: e.add_request("x", [1] * 128, SP()), ValueError, "'x'", "max_model_len=128"),
    row("prompt-bigger-than-pool", lambda e, d: e.add_request("x", [1] * 100, SP()), ValueError, "'x'", "KV blocks"),
    row("prompt-paper-over-token-budget", lambda e, d: paper_engine(e).add_request("x", [1] * 40, SP()), ValueError,
        "'x'", "40 tokens", "max_num_batched_tokens=32"),
    # ---- add_request: sampling_params, cache_salt, arrival_time
    row("params-dict", lambda e, d: e.add_request("x", [1, 2], {"n": 1}), TypeError, "sampling_params", "dict"),
    row("params-None", lambda e, d: e.add_request("x", [1, 2], None), TypeError, "sampling_params", "None"),
    row("n-over-max_num_seqs", lambda e, d: e.add_request("x", [1, 2], SP(n=201, temperature=1.0)), ValueError,
        "sampling_params.n=201", "max_num_seqs=200"),
    row("beam-over-vocab/2", lambda e, d: e.add_request("x", [1, 2], SP(n=129, use_beam_search=True)), ValueError,
        "sampling_params.n=129", "128", f"vocabulary of {VOCAB}"),
    row("stop-out-of-vocab", lambda e, d: e.add_request("x", [1, 2], SP(stop_token_ids=[3, VOCAB])), ValueError,
        "sampling_params.stop_token_ids[1]", str(VOCAB)),
    row("salt-list", lambda e, d: e.add_request("x", [1, 2], SP(), cache_salt=[1]), TypeError, "cache_salt", "[1]"),
    row("salt-int", lambda e, d: e.add_request("x", [1, 2], SP(), cache_salt=3), TypeError, "cache_salt", "int 3"),
    row("salt-bytes", lambda e, d: e.add_request("x", [1, 2], SP(), cache_salt=b"a"), TypeError, "cache_salt", "b'a'"),
    row("arrival-nan", lambda e, d: e.add_request("x", [1, 2], SP(), arrival_time=NAN), ValueError,
        "arrival_time", "nan"),
    row("arrival-str", lambda e, d: e.add_request("x", [1, 2], SP(), arrival_time="now"), TypeError,
        "arrival_time", "'now'"),
    # ---- generate: all checked before any is queued
    row("generate-bad-third-prompt", lambda e, d: e.generate([[1, 2], [3, 4], [1.5]], SP(), use_tqdm=False),
        TypeError, "prompts[2][0]", "1.5"),
    row("generate-bad-second-params", lambda e, d: e.generate([[1, 2], [3, 4]], [SP(), "greedy"], use_tqdm=False),
        TypeError, "sampling_params[1]", "'greedy'"),
    row("generate-params-count", lambda e, d: e.generate([[1, 2], [3, 4]], [SP()], use_tqdm=False), ValueError,
        "sampling_params", "1 given for 2 prompts"),
    row("generate-prompts-None", lambda e, d: e.generate(None, SP(), use_tqdm=False), TypeError, "prompts", "None"),
    row("generate-one-flat-prompt", lambda e, d: e.generate([1, 2, 3], SP(), use_tqdm=False), TypeError,
        "prompts[0]", "int 1"),
    row("generate-beam-over-vocab", lambda e, d: e.generate([[1], [2]], [SP(), SP(n=150, use_beam_search=True)],
                                                           use_tqdm=False), ValueError, "sampling_params[1].n=150"),
    # ---- abort
    row("abort-unknown", lambda e, d: e.abort("nope"), KeyError, "'nope'", "no such unfinished request"),
    row("abort-list", lambda e, d: e.abort(["bystander"]), TypeError, "request_id", "list"),
    row("abort-None", lambda e, d: e.abort(None), TypeError, "request_id", "None"),
    # ---- SamplingParams, field by field
    row("seed-negative", lambda e, d: SP(seed=-1), ValueError, "SamplingParams.seed", "-1", "[0, 4294967296)"),
    row("seed-2**32", lambda e, d: SP(seed=2**32), ValueError, "SamplingParams.seed", "4294967296"),
    row("seed-float", lambda e, d: SP(seed=1.0), TypeError, "SamplingParams.seed", "1.0"),
    row("seed-bool", lambda e, d: SP(seed=True), TypeError, "SamplingParams.seed", "bool"),
    row("n-float", lambda e, d: SP(n=2.0), TypeError, "SamplingParams.n", "2.0", ">= 1"),
    row("n-zero", lambda e, d: SP(n=0), ValueError, "SamplingParams.n", ">= 1", "got 0"),
    row("n-str", lambda e, d: SP(n="2"), TypeError, "SamplingParams.n", "'2'"),
    row("n-bool", lambda e, d: SP(n=True), TypeError, "SamplingParams.n", "bool"),
    row("temperature-nan", lambda e, d: SP(temperature=NAN), ValueError, "SamplingParams.temperature", "nan"),
    row("temperature-inf", lambda e, d: SP(temperature=float("inf")), ValueError, "SamplingParams.temperature", "inf"),
    row("temperature-over-float32", lambda e, d: SP(temperature=1e39), ValueError,
        "SamplingParams.temperature", "1e+39"),
    row("temperature-negative", lambda e, d: SP(temperature=-1.0), ValueError, "SamplingParams.temperature", "-1.0"),
    row("temperature-str", lambda e, d: SP(temperature="0.5"), TypeError, "SamplingParams.temperature", "'0.5'"),
    row("temperature-None", lambda e, d: SP(temperature=None), TypeError, "SamplingParams.temperature", "None"),
    row("top_k-fractional", lambda e, d: SP(top_k=2.5), TypeError, "SamplingParams.top_k", "2.5"),
    row("top_k-negative", lambda e, d: SP(top_k=-1), ValueError, "SamplingParams.top_k", "-1"),
    row("top_k-over-int32", lambda e, d: SP(top_k=2**31), ValueError, "SamplingParams.top_k", str(2**31)),
    row("top_p-zero", lambda e, d: SP(top_p=0.0), ValueError, "SamplingParams.top_p", "(0, 1]"),
    row("top_p-over-1", lambda e, d: SP(top_p=1.5), ValueError, "SamplingParams.top_p", "1.5"),
    row("top_p-nan", lambda e, d: SP(top_p=NAN), ValueError, "SamplingParams.top_p", "nan"),
    row("max_tokens-fractional", lambda e, d: SP(max_tokens=2.5), TypeError, "SamplingParams.max_tokens", "2.5"),
    row("max_tokens-zero", lambda e, d: SP(max_tokens=0), ValueError, "SamplingParams.max_tokens", ">= 1"),
    row("max_tokens-None", lambda e, d: SP(max_tokens=None), TypeError, "SamplingParams.max_tokens", "None"),
    row("length_penalty-nan", lambda e, d: SP(length_penalty=NAN), ValueError, "SamplingParams.length_penalty", "nan"),
    row("length_penalty-huge", lambda e, d: SP(length_penalty=1e308), ValueError,
        "SamplingParams.length_penalty", "1e+308", "[-10, 10]"),
    row("length_penalty-str", lambda e, d: SP(length_penalty="1"), TypeError, "SamplingParams.length_penalty", "'1'"),
    row("stop-int", lambda e, d: SP(stop_token_ids=2), TypeError, "SamplingParams.stop_token_ids", "int 2"),
    row("stop-str", lambda e, d: SP(stop_token_ids="ab"), TypeError, "SamplingParams.stop_token_ids", "'ab'"),
    row("stop-float-item", lambda e, d: SP(stop_token_ids=[1.5]), TypeError, "SamplingParams.stop_token_ids[0]", "1.5"),
    row("stop-negative", lambda e, d: SP(stop_token_ids=[-1]), ValueError, "SamplingParams.stop_token_ids[0]", "-1"),
    row("stop-bool-item", lambda e, d: SP(stop_token_ids=[True]), TypeError, "SamplingParams.stop_token_ids[0]"),
    row("ignore_eos-str", lambda e, d: SP(ignore_eos="yes"), TypeError, "SamplingParams.ignore_eos", "'yes'"),
    row("ignore_eos-int", lambda e, d: SP(ignore_eos=1), TypeError, "SamplingParams.ignore_eos", "int 1"),
    row("use_beam_search-int", lambda e, d: SP(use_beam_search=1), TypeError, "SamplingParams.use_beam_search"),
    row("output_kind-unknown", lambda e, d: SP(output_kind="stream"), ValueError, "SamplingParams.output_kind",
        "'stream'"),
    row("output_kind-list", lambda e, d: SP(output_kind=["final"]), ValueError, "SamplingParams.output_kind"),
    row("beam-with-temperature", lambda e, d: SP(n=2, use_beam_search=True, temperature=0.7), ValueError,
        "use_beam_search", "temperature=0.7"),
    row("beam-with-top_k", lambda e, d: SP(n=2, use_beam_search=True, top_k=5), ValueError,
        "use_beam_search", "top_k=5"),
    # ---- SamplingParams: the sampling controls (vLLM's ranges), and the door's vocabulary checks
    row("presence-over-2", lambda e, d: SP(presence_penalty=2.5), ValueError, "SamplingParams.presence_penalty",
        "[-2, 2]", "2.5"),
    row("frequency-str", lambda e, d: SP(frequency_penalty="1"), TypeError, "SamplingParams.frequency_penalty", "'1'"),
    row("repetition-zero", lambda e, d: SP(repetition_penalty=0.0), ValueError, "SamplingParams.repetition_penalty",
        "(0,", "got 0.0"),
    row("repetition-nan", lambda e, d: SP(repetition_penalty=NAN), ValueError, "SamplingParams.repetition_penalty"),
    row("logit_bias-list", lambda e, d: SP(logit_bias=[1, 2]), TypeError, "SamplingParams.logit_bias", "list"),
    row("logit_bias-str-key", lambda e, d: SP(logit_bias={"5": 1.0}), TypeError, "SamplingParams.logit_bias key",
        "'5'"),
    row("logit_bias-over-100", lambda e, d: SP(logit_bias={5: 101.0}), ValueError, "SamplingParams.logit_bias[5]",
        "[-100, 100]"),
    row("logit_bias-out-of-vocab", lambda e, d: e.add_request("x", [1, 2], SP(logit_bias={VOCAB: 1.0})), ValueError,
        "sampling_params.logit_bias keys[0]", str(VOCAB)),
    row("logit_bias-too-many", lambda e, d: SP(logit_bias={t: 1.0 for t in range(257)}), ValueError,
        "SamplingParams.logit_bias", "at most 256 entries", "got 257"),
    row("banned-too-many", lambda e, d: e.add_request("x", [1, 2], SP(
        bad_words_token_ids=[[t % VOCAB] for t in range(200)], min_tokens=1, max_tokens=4,
        stop_token_ids=list(range(100)))), ValueError, "sampling_params", "bad_words_token_ids (200 words)",
        "stop_token_ids", "at most 256"),
    row("min_tokens-over-max_tokens", lambda e, d: SP(min_tokens=5, max_tokens=4), ValueError,
        "SamplingParams.min_tokens", "max_tokens (4)", "got 5"),
    row("min_tokens-negative", lambda e, d: SP(min_tokens=-1), ValueError, "SamplingParams.min_tokens", "-1"),
    row("min_p-over-1", lambda e, d: SP(min_p=1.5), ValueError, "SamplingParams.min_p", "[0, 1]"),
    row("allowed-empty", lambda e, d: SP(allowed_token_ids=[]), ValueError, "SamplingParams.allowed_token_ids", "empty"),
    row("allowed-out-of-vocab", lambda e, d: e.add_request("x", [1, 2], SP(allowed_token_ids=[1, VOCAB + 5])),
        ValueError, "sampling_params.allowed_token_ids[1]", str(VOCAB + 5)),
    row("bad_words-without-ids", lambda e, d: e.add_request("x", [1, 2], SP(bad_words=["foo"])), ValueError,
        "sampling_params.bad_words", "tokenizer"),
    row("bad_words-empty-word", lambda e, d: SP(bad_words=[""]), ValueError, "SamplingParams.bad_words"),
    row("bad_words_token_ids-flat", lambda e, d: SP(bad_words_token_ids=[1, 2]), TypeError,
        "SamplingParams.bad_words_token_ids[0]", "int 1"),
    row("bad_words_token_ids-out-of-vocab", lambda e, d: e.add_request("x", [1, 2], SP(
        bad_words_token_ids=[[3], [4, VOCAB]])), ValueError, "sampling_params.bad_words_token_ids[1][1]"),
    row("best_of-under-n", lambda e, d: SP(n=3, best_of=2, temperature=1.0), ValueError, "SamplingParams.best_of",
        ">= n (3)"),
    row("best_of-over-max_num_seqs", lambda e, d: e.add_request("x", [1, 2], SP(best_of=201, temperature=1.0)),
        ValueError, "sampling_params.best_of=201", "max_num_seqs=200"),
    row("best_of-streamed", lambda e, d: SP(n=1, best_of=2, output_kind="delta"), ValueError,
        "SamplingParams.best_of=2", "output_kind"),
    row("constraint-str", lambda e, d: SP(constraint="json"), TypeError, "SamplingParams.constraint", "TokenConstraint"),
    row("constraint-past-vocab", lambda e, d: e.add_request("x", [1, 2], SP(constraint=DigitsThenEos(
        [5], 2, VOCAB + 1))), ValueError, "sampling_params.constraint.vocab_size", str(VOCAB + 1)),
    row("structured-outputs-str", lambda e, d: SP(structured_outputs="json"), TypeError,
        "SamplingParams.structured_outputs", "StructuredOutputsParams", "'json'"),
    row("structured-outputs-none-given", lambda e, d: SOP(), ValueError, "structured_outputs", "exactly one", "none"),
    row("structured-outputs-two-given", lambda e, d: SOP(regex="a+", choice=["a"]), ValueError,
        "structured_outputs", "regex and choice"),
    row("structured-outputs-choice-str", lambda e, d: SOP(choice="yes"), TypeError, "structured_outputs.choice",
        "'yes'"),
    row("structured-outputs-choice-empty", lambda e, d: SOP(choice=[]), ValueError, "structured_outputs.choice", "[]"),
    row("structured-outputs-choice-item", lambda e, d: SOP(choice=["a", 2]), TypeError,
        "structured_outputs.choice[1]", "int 2"),
    row("structured-outputs-regex-int", lambda e, d: SOP(regex=5), TypeError, "structured_outputs.regex", "int 5"),
    row("structured-outputs-json-list", lambda e, d: SOP(json=[1]), TypeError, "structured_outputs.json", "[1]"),
    row("structured-outputs-json-object-int", lambda e, d: SOP(json_object=1), TypeError,
        "structured_outputs.json_object", "int 1"),
    row("structured-outputs-and-constraint", lambda e, d: SP(structured_outputs=SOP(regex="a"), constraint=DigitsThenEos(
        [5], 2, VOCAB)), ValueError, "SamplingParams.structured_outputs", "not both"),
    row("structured-outputs-uncompiled", lambda e, d: e.add_request("x", [1, 2], SP(structured_outputs=SOP(
        regex="[0-9]+"))), ValueError, "sampling_params.structured_outputs", "tokenizer"),
    row("beam-with-controls", lambda e, d: SP(n=2, use_beam_search=True, repetition_penalty=1.2, min_tokens=2,
                                              logit_bias={1: 1.0}, best_of=3), ValueError,
        "use_beam_search does not support", "repetition_penalty", "logit_bias", "min_tokens", "best_of"),
    # ---- config dataclasses
    row("cache-block_size-3", lambda e, d: CacheConfig(block_size=3), ValueError, "cache.block_size", "power of two"),
    row("cache-block_size-float", lambda e, d: CacheConfig(block_size=16.0), TypeError, "cache.block_size", "16.0"),
    row("cache-num_blocks-1e20", lambda e, d: CacheConfig(num_blocks=10**20), ValueError,
        "cache.num_blocks", str(10**20)),
    row("cache-num_blocks-float", lambda e, d: CacheConfig(num_blocks=64.0), TypeError, "cache.num_blocks", "64.0"),
    row("cache-slots-over-int32", lambda e, d: CacheConfig(block_size=1024, num_blocks=2**22), ValueError,
        "cache.num_blocks", "int32"),
    row("cache-num_host_blocks-negative", lambda e, d: CacheConfig(num_host_blocks=-1), ValueError,
        "cache.num_host_blocks", "-1"),
    row("cache-watermark-nan", lambda e, d: CacheConfig(watermark=NAN), ValueError, "cache.watermark", "nan"),
    row("cache-watermark-str", lambda e, d: CacheConfig(watermark="0.1"), TypeError, "cache.watermark", "'0.1'"),
    row("cache-prefix-caching-str", lambda e, d: CacheConfig(enable_prefix_caching="yes"), TypeError,
        "cache.enable_prefix_caching"),
    row("cache-num_host_cache_blocks-negative", lambda e, d: CacheConfig(num_host_cache_blocks=-4), ValueError,
        "cache.num_host_cache_blocks", "-4"),
    row("cache-host-tier-without-prefix-cache", lambda e, d: CacheConfig(num_host_cache_blocks=64), ValueError,
        "cache.num_host_cache_blocks", "cache.enable_prefix_caching"),
    row("cache-host-pool-too-large", lambda e, d: CacheConfig(enable_prefix_caching=True, num_host_blocks=2**24,
                                                               num_host_cache_blocks=1), ValueError,
        "cache.num_host_cache_blocks", str(2**24 + 1)),
    row("cache-eviction_policy-fifo", lambda e, d: CacheConfig(eviction_policy="fifo"), ValueError,
        "cache.eviction_policy", "'fifo'"),
    # ---- pin_prefix: a busy engine (the bystander runs)
    row("pin_prefix-busy", lambda e, d: e.pin_prefix([1, 2, 3]), RuntimeError, "pin_prefix", "idle"),
    row("scheduler-max_num_seqs-float", lambda e, d: SchedulerConfig(max_num_seqs=2.0), TypeError,
        "scheduler.max_num_seqs", "2.0"),
    row("scheduler-max_num_seqs-zero", lambda e, d: SchedulerConfig(max_num_seqs=0), ValueError,
        "scheduler.max_num_seqs", "0"),
    row("scheduler-budget-below-seqs", lambda e, d: SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32),
        ValueError, "scheduler.max_num_batched_tokens", "32"),
    row("scheduler-max_model_len-huge", lambda e, d: SchedulerConfig(max_model_len=10**20), ValueError,
        "scheduler.max_model_len", str(10**20)),
    row("scheduler-preemption_mode", lambda e, d: SchedulerConfig(preemption_mode="drop"), ValueError,
        "scheduler.preemption_mode", "'drop'"),
    row("scheduler-policy-int", lambda e, d: SchedulerConfig(policy=1), ValueError, "scheduler.policy", "1"),
    row("scheduler-threshold-negative", lambda e, d: SchedulerConfig(long_prefill_token_threshold=-1), ValueError,
        "scheduler.long_prefill_token_threshold", "-1"),
    row("model-name-int", lambda e, d: ModelConfig(name=5), TypeError, "model.name", "int 5"),
    row("model-dtype-int8", lambda e, d: ModelConfig(dtype="int8"), ValueError, "model.dtype", "'int8'"),
    row("model-backend", lambda e, d: ModelConfig(attention_backend="cuda"), ValueError,
        "model.attention_backend", "'cuda'"),
    row("model-checkpoint-int", lambda e, d: ModelConfig(checkpoint=5), TypeError, "model.checkpoint", "int 5"),
    row("model-seed-negative", lambda e, d: ModelConfig(seed=-1), ValueError, "model.seed", "-1"),
    row("model-seed-float", lambda e, d: ModelConfig(seed=1.5), TypeError, "model.seed", "1.5"),
    row("model-tp-float", lambda e, d: ModelConfig(tensor_parallel_size=2.0), TypeError,
        "model.tensor_parallel_size", "2.0"),
    row("model-num_processes-zero", lambda e, d: ModelConfig(num_processes=0), ValueError, "model.num_processes", "0"),
    row("model-process_id-out", lambda e, d: ModelConfig(process_id=1), ValueError, "model.process_id", "[0, 1)"),
    row("engine-executor", lambda e, d: EngineConfig(executor="tpu"), ValueError, "executor", "'tpu'"),
    row("engine-model-wrong-class", lambda e, d: EngineConfig(model=CacheConfig()), TypeError, "model", "CacheConfig"),
    row("engine-cache-dict", lambda e, d: EngineConfig(cache={"block_size": 8}), TypeError, "cache", "dict"),
    row("engine-table-too-large", lambda e, d: EngineConfig(
        scheduler=SchedulerConfig(max_num_seqs=2**16, max_num_batched_tokens=2**16, max_model_len=2**20),
        cache=CacheConfig(block_size=1)), ValueError, "scheduler.max_num_seqs", "block-table entries"),
    row("cache-device-pool-too-big", lambda e, d: LLMEngine(tiny_config(num_blocks=2**15, block_size=2**15)),
        ValueError, "cache.num_blocks", "32768 blocks", "GiB"),
    row("cache-host-pool-too-big", lambda e, d: LLMEngine(tiny_config(num_host_blocks=2**24 - 1, block_size=64)),
        ValueError, "cache.num_host_blocks", "16777215 blocks", "host memory"),
    row("engine-config-not-a-config", lambda e, d: LLMEngine({"executor": "sim"}), TypeError, "config", "dict"),
    row("engine-executor-not-an-executor", lambda e, d: LLMEngine(e.config, executor="jax"), TypeError,
        "executor", "str"),
    row("config_from_dict-list", lambda e, d: config_from_dict(CacheConfig, [1, 2]), TypeError, "<dict>", "list"),
    # ---- YAML files (jpaged's configs and experiments' configs through load_config)
    yaml_row("yaml-duplicate-key", "num_requests: 10\nseed: 1\nnum_requests: 20\n", BenchHostConfig, ValueError,
             "{file}", "line 3", "duplicate key 'num_requests'", "first on line 1"),
    yaml_row("yaml-duplicate-nested-key", "cache:\n  block_size: 8\n  block_size: 16\n", BenchHostConfig, ValueError,
             "{file}", "line 3", "'block_size'"),
    yaml_row("yaml-duplicate-flow-key", "cache: {block_size: 8, block_size: 16}\n", BenchHostConfig, ValueError,
             "{file}", "line 1", "'block_size'"),
    yaml_row("yaml-1e20-int-field", "cache:\n  num_blocks: 1e20\n", BenchHostConfig, TypeError,
             "{file}", "cache.num_blocks", "1e+20"),
    yaml_row("yaml-huge-int", "cache:\n  num_blocks: 100000000000000000000\n", BenchHostConfig, ValueError,
             "{file}", "cache.num_blocks"),
    yaml_row("yaml-huge-int-experiment-field", "num_requests: 100000000000000000000\n", BenchHostConfig, ValueError,
             "{file}", "num_requests", "64 bits"),
    yaml_row("yaml-float-for-int", "scheduler:\n  max_num_seqs: 2.0\n", BenchHostConfig, TypeError,
             "{file}", "scheduler.max_num_seqs", "2.0"),
    yaml_row("yaml-nan", "cache:\n  watermark: .nan\n", BenchHostConfig, ValueError,
             "{file}", "cache.watermark", "nan"),
    yaml_row("yaml-nan-experiment-field", "prompt_mu: .nan\n", BenchHostConfig, ValueError,
             "{file}", "prompt_mu", "nan"),
    yaml_row("yaml-range", "cache:\n  watermark: 1.5\n", BenchHostConfig, ValueError,
             "{file}", "cache.watermark", "1.5"),
    yaml_row("yaml-unknown-key", "cahce: {}\n", BenchHostConfig, ValueError, "{file}", "unknown key", "cahce"),
    yaml_row("yaml-int-key", "1: 2\nseed: 3\n", BenchHostConfig, ValueError, "{file}", "unknown key", "1"),
    yaml_row("yaml-top-level-list", "- 1\n- 2\n", BenchHostConfig, TypeError, "{file}", "mapping", "list"),
    yaml_row("yaml-syntax", "cache: [1, 2\n", BenchHostConfig, ValueError, "{file}", "not valid YAML"),
    yaml_row("yaml-not-utf8", b"seed: \xff\xfe\n", BenchHostConfig, ValueError, "{file}", "not valid YAML"),
    yaml_row("yaml-python-tag-never-runs", "seed: !!python/object/apply:os.getpid []\n", BenchHostConfig, ValueError,
             "{file}", "python/object/apply"),
    yaml_row("yaml-mapping-for-list", "policies: {a: 1}\n", BenchHostConfig, TypeError, "{file}", "policies", "list"),
    yaml_row("yaml-experiment-range", "num_requests: 0\n", BenchHostConfig, ValueError, "{file}", "num_requests", "0"),
    yaml_row("yaml-experiment-policies", "policies: [fast]\n", BenchHostConfig, ValueError,
             "{file}", "policies", "fast"),
    yaml_row("yaml-throughput-system", "systems: [tgi]\nrates: {tgi: [1.0]}\n", ThroughputConfig, ValueError,
             "{file}", "tgi"),
    yaml_row("yaml-model-dtype", "model: {name: tiny-opt, dtype: int8}\n", ThroughputConfig, ValueError,
             "{file}", "model.dtype", "int8"),
    yaml_row("yaml-workload-rate", "request_rate: -1\nnum_requests: 5\n", WorkloadConfig, ValueError,
             "{file}", "request_rate", "-1"),
    yaml_row("yaml-workload-num_requests-float", "num_requests: 1e3\n", WorkloadConfig, TypeError,
             "{file}", "num_requests", "1000.0"),
    row("yaml-missing-file", lambda e, d: load_config(d / "absent.yaml", BenchHostConfig), FileNotFoundError,
        "absent.yaml"),
]


@pytest.mark.parametrize("call, exc, names", CASES)
def test_bad_input_is_refused_clearly_and_the_engine_keeps_serving(engine, reference, tmp_path, call, exc, names):
    engine.add_request("bystander", GOOD_PROMPT, SP(max_tokens=GOOD_TOKENS))
    engine.step()  # the bystander is running while the bad input arrives
    queued = set(engine._groups)
    with pytest.raises(exc) as info:
        call(engine, tmp_path)
    message = str(info.value)
    for name in names:
        assert name.replace("{file}", str(tmp_path / "bad.yaml")) in message, message
    assert set(engine._groups) == queued, "a refused call left something queued"
    engine.add_request("after", GOOD_PROMPT, SP(max_tokens=GOOD_TOKENS))
    outputs = run_to_end(engine)
    assert {k: (o.output_token_ids, o.error) for k, o in outputs.items()} == {
        "bystander": ([reference], None), "after": ([reference], None)}
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.scheduler.block_manager.refcount.any()


def test_numpy_scalars_and_arrays_are_accepted_as_plain_values(engine, reference):
    """The other side of the strict checks: numpy integers and integer arrays are ints."""
    params = SP(max_tokens=np.int64(GOOD_TOKENS), seed=np.uint32(7), top_k=np.int32(0), temperature=np.float32(0),
                stop_token_ids=np.array([], np.int64), n=np.int8(1))
    assert type(params.max_tokens) is int and type(params.seed) is int and params.stop_token_ids == ()
    assert type(params.temperature) is float
    engine.add_request("np", np.array(GOOD_PROMPT, np.int16), params)
    assert run_to_end(engine)["np"].output_token_ids == [reference]
    assert CacheConfig(num_blocks=np.int64(8)).num_blocks == 8


def test_yaml_reads_exponent_floats_as_numbers(tmp_path):
    """YAML 1.2 floats: 1.5e-3 and 2e-2 are numbers (PyYAML's YAML 1.1 would read 2e-2 as a string)."""
    path = tmp_path / "ok.yaml"
    path.write_text("cache:\n  watermark: 2e-2\nprompt_mu: 46e-1\n")
    config = load_config(path, BenchHostConfig)
    assert config.cache.watermark == 0.02 and config.prompt_mu == 4.6


def test_abort_frees_blocks_and_reports():
    engine = make_engine()
    engine.add_request("a", list(range(1, 40)), SP(max_tokens=50))
    engine.add_request("b", list(range(1, 10)), SP(max_tokens=3))
    engine.step()
    engine.abort("a")
    outputs = run_to_end(engine)
    assert outputs["a"].finish_reasons == ["abort"]
    assert outputs["b"].finish_reasons == ["length"] and len(outputs["b"].output_token_ids[0]) == 3
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]
