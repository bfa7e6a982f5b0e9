"""Bad requests get clear errors naming the problem, and the engine keeps serving the others."""

import pytest

from jpaged.sequence import SamplingParams

from tests.helpers.tiny_engines import dense_greedy, make_engine


@pytest.fixture(scope="module")
def engine_with_good_request():
    engine = make_engine(num_blocks=13)
    engine.add_request("good", [5, 6, 7, 8], SamplingParams(max_tokens=5))
    engine.step()  # the good request is running while the bad ones arrive
    return engine


@pytest.mark.parametrize("make_bad, match", [
    (lambda e: e.add_request("x", [], SamplingParams()), "prompt_token_ids is empty"),
    (lambda e: e.add_request("x", [1] * 128, SamplingParams()), "max_model_len=128"),
    (lambda e: e.add_request("x", [1] * 100, SamplingParams()), "KV blocks"),  # 12 usable blocks of 8 < 101
    (lambda e: e.add_request("x", [1, 999], SamplingParams()), r"token ids must be in \[0, 256\)"),
    (lambda e: e.add_request("good", [1, 2], SamplingParams()), "already in use"),
    (lambda e: e.abort("nope"), "no such unfinished request"),
    (lambda e: SamplingParams(n=0), "n must be >= 1"),
    (lambda e: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (lambda e: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (lambda e: SamplingParams(temperature=-1.0), "temperature must be >= 0"),
    (lambda e: SamplingParams(n=2, use_beam_search=True, temperature=0.7), "use_beam_search needs temperature 0"),
    (lambda e: SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
])
def test_bad_input_is_refused_clearly(engine_with_good_request, make_bad, match):
    with pytest.raises((ValueError, KeyError), match=match):
        make_bad(engine_with_good_request)


def test_engine_still_serves_after_bad_input(engine_with_good_request):
    engine = engine_with_good_request
    with pytest.raises(ValueError):
        engine.add_request("bad", [], SamplingParams())
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["good"]
    assert outputs[0].output_token_ids == dense_greedy("tiny-opt", [[5, 6, 7, 8]], 5)
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]


def test_abort_frees_blocks_and_reports():
    engine = make_engine()
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=50))
    engine.add_request("b", list(range(1, 10)), SamplingParams(max_tokens=3))
    engine.step()
    engine.abort("a")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].finish_reasons == ["abort"]
    assert by_id["b"].finish_reasons == ["length"] and len(by_id["b"].output_token_ids[0]) == 3
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]
