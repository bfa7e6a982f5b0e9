"""The text request path (TextRequests): a request is queued in the processor and the engine or in
neither, a batch all or none, an abort comes back through the processor. On the simulator's
executor (pure Python, no compilation) and without a tokenizer (token ids only)."""

import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.constraints import StructuredOutputsParams
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.paper.sim.executor import SimExecutor
from jpaged.text.requests import TextRequest, TextRequests

PROMPT = [5, 6, 7, 8]


@pytest.fixture
def requests():
    config = EngineConfig(model=ModelConfig(name="tiny-opt"), executor="sim",
                          cache=CacheConfig(block_size=8, num_blocks=32, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64))
    engine = LLMEngine(config, executor=SimExecutor(get_preset("tiny-opt"), block_size=8))
    return TextRequests(engine, tokenizer=None)


def holds_nothing(requests, request_id):
    """Neither the processor nor the engine knows `request_id`."""
    with pytest.raises(KeyError):
        requests.engine.abort(request_id)
    return request_id not in requests.processor and not requests.has_unfinished()


@pytest.mark.parametrize("prompt_ids, params, match", [
    ([5, 10**6], SamplingParams(), r"prompt.*outside the vocabulary"),  # the engine's check
    ([5] * 65, SamplingParams(), "max_model_len"),  # the engine's check
    (PROMPT, SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),  # its engine params
     "structured_outputs: need the model's tokenizer"),
])
def test_a_request_the_engine_refuses_leaves_the_processor_empty(requests, prompt_ids, params, match):
    with pytest.raises(ValueError, match=match):
        requests.add(TextRequest("a", prompt_ids, params))
    assert holds_nothing(requests, "a")
    requests.add(TextRequest("a", PROMPT, SamplingParams(max_tokens=2)))  # the id is free again
    assert "a" in requests.processor and requests.has_unfinished()


def test_a_request_the_processor_refuses_never_reaches_the_engine(requests):
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        requests.add(TextRequest("a", PROMPT, SamplingParams(stop=["x"])))
    assert holds_nothing(requests, "a")
    requests.add(TextRequest("b", PROMPT, SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match="request_id: 'b' is already in use"):
        requests.add(TextRequest("b", PROMPT, SamplingParams(max_tokens=2)))
    assert "b" in requests.processor  # the refused duplicate left the first one as it was
    outputs = [out for _ in range(10) if requests.has_unfinished() for out in requests.step()]
    assert [(o.request_id, o.finished, len(o.outputs[0].token_ids)) for o in outputs] == [("b", True, 2)]


def test_a_batch_is_queued_all_or_none(requests):
    ok = TextRequest("r0", PROMPT, SamplingParams(max_tokens=2))
    # Refused by the engine's check: nothing was queued, and the error names the batch's field.
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        requests.add_all([ok, TextRequest("r1", [5, 10**6], SamplingParams())])
    assert holds_nothing(requests, "r0") and holds_nothing(requests, "r1")
    # Refused by the processor after r0 was queued: r0 is withdrawn, its aborted output read by nobody.
    with pytest.raises(ValueError, match="stop: stop strings need a tokenizer"):
        requests.add_all([ok, TextRequest("r1", PROMPT, SamplingParams(stop=["x"]))])
    assert "r0" not in requests.processor and "r1" not in requests.processor
    assert requests.step() == [] and holds_nothing(requests, "r0")
    requests.add_all([ok, TextRequest("r1", PROMPT, SamplingParams(max_tokens=3, n=2))])
    finished = {o.request_id: o for _ in range(10) if requests.has_unfinished() for o in requests.step()
                if o.finished}
    assert {i: [len(c.token_ids) for c in o.outputs] for i, o in finished.items()} == {"r0": [2], "r1": [3, 3]}


def test_an_abort_comes_back_through_the_processor(requests):
    requests.add(TextRequest("a", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, output_kind="delta")))
    first = requests.step()
    assert [o.request_id for o in first] == ["a"] and not first[0].finished
    requests.abort("a")
    requests.abort("a")  # aborted already, and an unknown id: nothing to stop
    requests.abort("never-added")
    last = requests.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in last] == [("a", True, "abort")]
    assert holds_nothing(requests, "a")
