"""Random junk at the door (hypothesis, issue 14): any JSON-like value (and numpy arrays and scalars)
in each SamplingParams field and each add_request argument is either refused at once with a
TypeError / ValueError, or becomes a request that completes on the real tiny model: no error, every
token in the vocabulary, no more than max_tokens, every block back, the engine still serving."""

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jpaged.core.sequence import SamplingParams
from tests.helpers.tiny_engines import make_engine

VOCAB = 256  # tiny-opt
FIELDS = ["n", "use_beam_search", "temperature", "top_k", "top_p", "max_tokens", "stop_token_ids", "ignore_eos",
          "seed", "length_penalty", "output_kind"]

json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6)
numpy_like = (hnp.arrays(st.sampled_from([np.int8, np.int32, np.uint64, np.float32, np.float64, np.bool_]),
                         hnp.array_shapes(min_dims=0, max_dims=2, max_side=4))
              | st.integers(-3, 300).map(np.int64) | st.floats(-2, 2).map(np.float32))
junk = json_like | numpy_like
# Per field, values around its valid range, so that half the draws reach the step.
near_valid = {
    "n": st.integers(-1, 9),
    "use_beam_search": st.booleans() | st.integers(0, 1),
    "temperature": st.floats(-0.5, 3.0) | st.integers(-1, 3) | st.sampled_from([1e-30, 1e38, 1e39]),
    "top_k": st.integers(-1, 300) | st.sampled_from([2**31 - 1, 2**31]),
    "top_p": st.floats(-0.1, 1.2) | st.sampled_from([1e-30, 1]),
    "max_tokens": st.integers(-1, 10) | st.sampled_from([10**12, 2**70]),
    "stop_token_ids": st.lists(st.integers(-1, VOCAB), max_size=3) | st.tuples(st.integers(0, VOCAB - 1)),
    "ignore_eos": st.booleans(),
    "seed": st.integers(-1, 4) | st.sampled_from([2**32 - 1, 2**32]),
    "length_penalty": st.floats(-12.0, 12.0),
    "output_kind": st.sampled_from(["final", "delta", "cumulative", "stream"]),
}


@pytest.fixture(scope="module")
def engine():
    # Room for the widest beam (8 x 4 blocks of 8) so that an accepted request never outgrows the pool.
    return make_engine(num_blocks=64, max_num_seqs=8, max_model_len=32, prefix_caching=True)


def refused_or_completed(engine, request_id, prompt, make_params, **kwargs):
    """Builds the params and adds the request; a TypeError / ValueError means refused (nothing queued),
    anything else must complete cleanly."""
    queued = set(engine._groups)
    try:
        params = make_params()
        engine.add_request(request_id, prompt, params, **kwargs)
    except (TypeError, ValueError) as exc:
        assert str(exc), "an error without a message"
        assert set(engine._groups) == queued
        event(f"refused: {type(exc).__name__}")
        return None
    finals = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finals += [o for o in engine.step() if o.finished]
    assert not engine.has_unfinished()
    (final,) = finals
    event("completed")
    assert final.error is None, final.error
    for completion in final.outputs:
        assert all(0 <= t < VOCAB for t in completion.token_ids)
        assert len(completion.token_ids) <= params.max_tokens
        assert completion.finish_reason in ("stop", "length", "abort")  # abort: a beam beaten by others
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and not engine.scheduler.block_manager.refcount.any()
    return final


_counter = iter(range(10**9))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), field=st.sampled_from(FIELDS))
def test_junk_in_one_sampling_field(engine, data, field):
    value = data.draw(near_valid[field] if data.draw(st.booleans(), label="near valid") else junk, label=field)
    refused_or_completed(engine, f"f{next(_counter)}", [5, 6, 7], lambda: SamplingParams(**{field: value}))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), fields=st.sets(st.sampled_from(FIELDS), min_size=2, max_size=5))
def test_junk_in_several_sampling_fields(engine, data, fields):
    values = {f: data.draw(near_valid[f] if data.draw(st.integers(0, 3), label="mostly valid") else junk, label=f)
              for f in sorted(fields)}
    refused_or_completed(engine, f"m{next(_counter)}", [5, 6, 7], lambda: SamplingParams(**values))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argument=st.sampled_from(["request_id", "prompt", "cache_salt", "arrival_time"]),
       value=junk | st.lists(st.integers(-1, VOCAB), min_size=1, max_size=20) | st.text(max_size=8)
       | st.floats(-1e3, 1e3) | hnp.arrays(np.int64, st.integers(1, 20), elements=st.integers(0, VOCAB - 1)))
def test_junk_in_add_request(engine, argument, value):
    request = {"request_id": f"a{next(_counter)}", "prompt": [5, 6, 7], "cache_salt": None, "arrival_time": None}
    request[argument] = value
    if argument == "request_id" and isinstance(value, str) and value in engine._groups:
        return  # an id in use is refused by design (tested in the table)
    refused_or_completed(engine, request["request_id"], request["prompt"], lambda: SamplingParams(max_tokens=4),
                         cache_salt=request["cache_salt"], arrival_time=request["arrival_time"])
