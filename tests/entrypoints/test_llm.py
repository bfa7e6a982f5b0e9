"""The offline API on the asset model: text in, text out, EOS, stop strings ended in the engine, errors."""

import pytest

from jpaged import LLM, SamplingParams
from jpaged.entrypoints.engine_args import engine_config
from tests.helpers.text_assets import ASSET

EOS_PROMPT = "x = 1"  # the asset's greedy continuation reaches an EOS id after ~30 tokens (measured)


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla", warmup=False)


def free_blocks(llm):
    stats = llm.engine.kv_stats()
    return stats["num_free_blocks"] == stats["num_total_blocks"]


def test_text_and_token_prompts_give_text_and_ids(llm):
    tok = llm.get_tokenizer()
    by_text = llm.generate(["def fibonacci(n):", "import os\n"], SamplingParams(max_tokens=12), use_tqdm=False)
    by_ids = llm.generate(tok.encode("def fibonacci(n):"), SamplingParams(max_tokens=12), use_tqdm=False)
    one = llm.generate("def fibonacci(n):", SamplingParams(max_tokens=12), use_tqdm=False)
    assert len(by_text) == 2 and len(by_ids) == len(one) == 1
    first = by_text[0].outputs[0]
    assert first.text == tok.decode(first.token_ids) and first.finish_reason == "length"
    assert by_ids[0].outputs[0].token_ids == one[0].outputs[0].token_ids == first.token_ids
    assert by_text[0].prompt == "def fibonacci(n):" and by_ids[0].prompt is None
    assert by_text[0].prompt_token_ids == tok.encode("def fibonacci(n):")
    assert free_blocks(llm)


def test_generation_stops_at_the_models_eos_unless_ignore_eos(llm):
    eos = set(llm.get_tokenizer().eos_token_ids)
    assert eos == {2, 4}  # <|eos|>, and <|im_end|> from generation_config.json
    free = llm.generate(EOS_PROMPT, SamplingParams(max_tokens=60, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    first_eos = next(i for i, t in enumerate(free.token_ids) if t in eos)
    stopped = llm.generate(EOS_PROMPT, SamplingParams(max_tokens=60), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: first_eos + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None  # EOS, not a stop token id
    explicit = llm.generate(EOS_PROMPT, SamplingParams(max_tokens=60, ignore_eos=True,
                                                       stop_token_ids=(free.token_ids[3],)), use_tqdm=False)
    assert explicit[0].outputs[0].token_ids == free.token_ids[: free.token_ids.index(free.token_ids[3]) + 1]
    assert explicit[0].outputs[0].stop_reason == free.token_ids[3]


@pytest.mark.parametrize("prompt, stop, extra", [
    ("import os\n", "newline", {"min_tokens": 20}),  # the stop id after min_tokens
    ("import os\n", "newline", {}),
    (EOS_PROMPT, "eos", {"skip_special_tokens": False}),  # EOS's text "<|im_end|>" would show
])
def test_a_stop_token_id_or_eos_stays_in_token_ids_but_not_in_text(llm, prompt, stop, extra):
    tok = llm.get_tokenizer()
    stop_ids = tok.encode("\n", add_special_tokens=False) if stop == "newline" else []
    skip = extra.get("skip_special_tokens", True)
    ids = set(stop_ids) | (set(tok.eos_token_ids) if stop == "eos" else set())
    for include in (False, True):  # vLLM: include_stop_str_in_output keeps the stop token's text
        params = SamplingParams(max_tokens=40, stop_token_ids=stop_ids, include_stop_str_in_output=include, **extra)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] in ids
        assert len(out.token_ids) > extra.get("min_tokens", 0)
        kept = out.token_ids if include else out.token_ids[:-1]
        assert out.text == tok.decode(kept, skip_special_tokens=skip), (include, out.text)


def test_stop_strings_end_the_sample_in_the_engine(llm):
    tok = llm.get_tokenizer()
    prompt = "def fibonacci(n):"
    free = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop = '"""'
    assert stop in free.text
    out = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == free.text[: free.text.index(stop)]
    # The engine computed no token past the stop: the ids end with the one that completed it.
    assert c.token_ids == free.token_ids[: len(c.token_ids)]
    assert stop in tok.decode(c.token_ids) and stop not in tok.decode(c.token_ids[:-1])
    assert free_blocks(llm)
    kept = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == c.text + stop


def test_a_stop_string_ends_one_sample_while_the_other_goes_on(llm):
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True)
    free = llm.generate("import", params, use_tqdm=False)[0].outputs
    stop = next(ch for ch in free[0].text if ch not in free[1].text)  # in sample 0's text only
    out = llm.generate("import", SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=30, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs
    assert out[0].finish_reason == "stop" and out[0].text == free[0].text[: free[0].text.index(stop)]
    assert out[1].finish_reason == "length" and out[1].token_ids == free[1].token_ids
    assert free_blocks(llm)


def test_chat_renders_the_template(llm):
    messages = [{"role": "user", "content": "Return x squared."}]
    out = llm.chat(messages, SamplingParams(max_tokens=8), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert tok.decode(out.prompt_token_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_bad_prompts_name_the_prompt_and_leave_nothing_queued(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        llm.generate(["ok", ""], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\]\[1\]: token id 1000000 is outside the vocabulary"):
        llm.generate([[1, 2], [5, 10**6]], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # A lone UTF-16 surrogate (what JSON's "\\ud800" decodes to) has no UTF-8 form: no tokenizer reads it.
    with pytest.raises(ValueError, match=r"prompts\[1\]: is not valid Unicode text: the lone surrogate '\\ud800' at "
                                         r"character 3"):
        llm.generate(["ok", "abc\ud800def"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages: is not valid Unicode text"):
        llm.chat([{"role": "user", "content": "x\udfff"}], use_tqdm=False)
    llm.generate("x", SamplingParams(max_tokens=1), use_tqdm=False)  # drains what the failures aborted
    assert not llm.engine.has_unfinished() and free_blocks(llm)


def test_engine_arguments_are_checked_by_name():
    with pytest.raises(TypeError, match="no_such_arg"):
        engine_config(str(ASSET), no_such_arg=1)
    with pytest.raises(ValueError, match="max_model_len"):
        engine_config(str(ASSET), max_model_len=4096)  # the asset has 512 positions
    assert engine_config(str(ASSET)).scheduler.max_model_len == 512
    config = engine_config(str(ASSET), block_size=32, max_num_seqs=8, enable_prefix_caching=True)
    assert (config.cache.block_size, config.scheduler.max_num_seqs, config.cache.enable_prefix_caching) == (32, 8, True)
    assert config.model.checkpoint == str(ASSET) and config.model.name == "stdlib-lm"
    with pytest.raises(ValueError, match="model"):
        engine_config("no-such-model")


def test_a_preset_without_tokenizer_takes_token_ids_only():
    llm = LLM("tiny-llama", num_blocks=32, block_size=8, max_model_len=64, attention_backend="xla", warmup=False)
    assert llm.get_tokenizer() is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", use_tqdm=False)


def test_pinned_prefixes_are_pre_stored_and_change_no_token(llm):
    system = "# A careful Python programmer writes small, tested functions.\n"
    prompts = [system + "def add(a, b):", system + "import sys\n"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    pinned = LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla",
                 enable_prefix_caching=True, pinned_prefixes=[system], warmup=False)
    length = len(pinned.get_tokenizer().encode(system))
    assert pinned.engine.kv_stats()["num_pinned_blocks"] == -(-length // 16)
    assert pinned.pin_prefix(system) == -(-length // 16)  # pinned already: nothing changes
    assert [o.outputs[0].token_ids for o in pinned.generate(prompts, params, use_tqdm=False)] == expected
    assert pinned.engine.kv_stats()["prefix_cached_tokens"] >= 2 * (length // 16) * 16
    with pytest.raises(ValueError, match="pinned_prefixes"):
        LLM(str(ASSET), num_blocks=128, block_size=16, enable_prefix_caching=True, pinned_prefixes=[""], warmup=False)


def test_llm_compiles_its_grid_at_construction():
    """LLM warms up by default: every program of its config, counted; generating compiles nothing more."""
    llm = LLM("tiny-llama", num_blocks=32, block_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
              attention_backend="xla")
    report = llm.warmup_report
    assert report["num_programs"] == report["num_compilations"] == llm.engine.kv_stats()["num_compilations"]
    llm.generate([[5, 6, 7]] * 3, [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, temperature=1.0, seed=1),
                                    SamplingParams(max_tokens=4, logprobs=3)], use_tqdm=False)
    assert llm.engine.kv_stats()["num_compilations"] == report["num_compilations"]
