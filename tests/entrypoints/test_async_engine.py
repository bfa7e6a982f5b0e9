"""AsyncLLMEngine: concurrent streams equal the offline answers, cancelling aborts and frees, refused
requests raise before streaming, a slow reader gets merged deltas, shutdown ends everything."""

import asyncio
import itertools
import threading

import pytest

from jpaged import LLM, AsyncLLMEngine, SamplingParams
from jpaged.entrypoints.async_engine import EngineDeadError, RequestAborted
from tests.helpers.text_assets import ASSET

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "x = 1"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla", warmup=False)


def serve(llm, body):
    """Runs `body(engine)` on a fresh AsyncLLMEngine over the module's engine, then shuts it down."""
    async def main():
        engine = AsyncLLMEngine(llm.engine, llm.get_tokenizer())
        try:
            return await body(engine)
        finally:
            engine.shutdown()
    return asyncio.run(main())


def all_free(llm):
    stats = llm.engine.kv_stats()
    return stats["num_free_blocks"] == stats["num_total_blocks"]


def test_concurrent_streams_equal_offline_outputs(llm):
    params = SamplingParams(max_tokens=24, stop=["\n\n"])
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    async def body(engine):
        async def one(prompt, kind):
            texts = [out.outputs[0].text async for out in engine.generate(prompt, SamplingParams(
                max_tokens=24, stop=["\n\n"], output_kind=kind)) if out.outputs]
            return "".join(texts) if kind == "delta" else texts[-1]
        return await asyncio.gather(*(one(p, k) for p in PROMPTS for k in ("delta", "cumulative", "final")))

    got = serve(llm, body)
    assert got == [e for e in expected for _ in range(3)]
    assert all_free(llm)


def test_closing_a_stream_aborts_the_request_and_frees_its_blocks(llm):
    async def body(engine):
        stream = await engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True,
                                                                             output_kind="delta"))
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        held = not all_free(llm)
        await stream.aclose()
        for _ in range(100):  # the engine thread applies the abort at its next step
            if all_free(llm) and not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.05)
        return held

    assert serve(llm, body) and all_free(llm) and not llm.engine.has_unfinished()


def test_cancelling_the_consumer_task_aborts_too(llm):
    async def body(engine):
        async def consume():
            async for _ in engine.generate(PROMPTS[1], SamplingParams(max_tokens=400, ignore_eos=True,
                                                                      output_kind="delta")):
                pass
        task = asyncio.ensure_future(consume())
        while all_free(llm):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if all_free(llm):
                return True
            await asyncio.sleep(0.05)
        return False

    assert serve(llm, body)


def test_refused_requests_raise_and_others_go_on(llm):
    async def body(engine):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("bad", [1, 10**6], SamplingParams())
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_request("empty", "", SamplingParams())
        outs = [o async for o in engine.generate(PROMPTS[2], SamplingParams(max_tokens=5))]
        return outs[-1].outputs[0].text

    assert serve(llm, body) == llm.generate(PROMPTS[2], SamplingParams(max_tokens=5),
                                            use_tqdm=False)[0].outputs[0].text


def test_a_slow_reader_gets_merged_deltas(llm):
    async def body(engine):
        stream = await engine.add_request("slow", PROMPTS[3], SamplingParams(max_tokens=30, ignore_eos=True,
                                                                             output_kind="delta"))
        await asyncio.sleep(1.0)  # the engine runs ahead: its deltas wait, merged
        chunks = [out async for out in stream]
        return chunks

    chunks = serve(llm, body)
    assert len(chunks) < 30
    tokens = [t for c in chunks for t in c.outputs[0].token_ids]
    final = llm.generate(PROMPTS[3], SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert tokens == final.token_ids and "".join(c.outputs[0].text for c in chunks) == final.text


def test_after_shutdown_requests_fail(llm):
    async def body(engine):
        async for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=2)):
            pass
        engine.shutdown()
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", PROMPTS[0], SamplingParams())
        return True

    assert serve(llm, body)


def test_an_event_loop_closed_without_shutdown_ends_the_step_loop_quietly(llm, caplog):
    """The loop's owner went away mid-request: the step thread stops, logs no failure, and the
    engine is left for the next owner (its blocks free once the next engine aborts the request)."""
    engine = AsyncLLMEngine(llm.engine, llm.get_tokenizer())

    async def start_one():
        stream = await engine.add_request("orphan", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True,
                                                                               output_kind="delta"))
        await stream.__anext__()  # the first token: 399 steps to go, each posting its output

    loop = asyncio.new_event_loop()
    loop.run_until_complete(start_one())
    loop.close()
    engine._thread.join(timeout=30)
    assert not engine._thread.is_alive()
    assert "step loop failed" not in caplog.text
    assert engine.is_dead
    llm.engine.abort("orphan")
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert all_free(llm)


def test_stream_interval_sends_the_first_token_then_every_n_steps(llm):
    async def body(engine):
        return [out async for out in engine.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                                output_kind="delta"))]

    async def with_interval():
        engine = AsyncLLMEngine(llm.engine, llm.get_tokenizer(), stream_interval=8)
        try:
            return await body(engine)
        finally:
            engine.shutdown()

    chunks = asyncio.run(with_interval())
    # Reports after the first token, then every 8 steps, and at the end (a slow reader may merge some).
    ends = list(itertools.accumulate(len(c.outputs[0].token_ids) for c in chunks))
    assert set(ends) <= {1, 9, 17, 20} and ends[-1] == 20 and len(chunks) >= 2
    final = llm.generate(PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert "".join(c.outputs[0].text for c in chunks) == final.text
    assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"


def test_abort_all_ends_every_reader_at_once_and_frees_the_blocks(llm):
    async def body(engine):
        streams = [await engine.add_request(f"r{i}", p, SamplingParams(max_tokens=400, ignore_eos=True,
                                                                       output_kind="delta"))
                   for i, p in enumerate(PROMPTS[:2])]
        first = [await anext(s) for s in streams]  # both are running
        assert engine.num_open_requests == 2 and engine.abort_all("shutting down") == 2
        for stream in streams:
            with pytest.raises(RequestAborted, match="shutting down"):
                async for _ in stream:  # what was pending, then the abort (not waiting for a step)
                    pass
            await stream.aclose()
        # The engine applies the aborts at its next step: no block stays referenced.
        for _ in range(200):
            if all_free(llm) and not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        return first

    assert all(out.outputs[0].token_ids for out in serve(llm, body))
    assert all_free(llm)


def test_text_prompts_are_encoded_off_the_event_loop_and_the_cache_salt_reaches_the_engine(llm):
    async def body(engine):
        loop_thread = threading.get_ident()
        encoded_on, salts = [], []
        encode, add = engine.tokenizer.encode, engine.engine.add_request

        def spy_encode(*args, **kwargs):
            encoded_on.append(threading.get_ident())
            return encode(*args, **kwargs)

        def spy_add(*args, **kwargs):
            salts.append(kwargs.get("cache_salt"))
            return add(*args, **kwargs)

        engine.tokenizer.encode, engine.engine.add_request = spy_encode, spy_add
        try:
            stream = await engine.add_request("salted", PROMPTS[1], SamplingParams(max_tokens=2), cache_salt="tenant")
            outputs = [out async for out in stream]
        finally:
            del engine.tokenizer.encode, engine.engine.add_request
        return loop_thread, encoded_on, salts, outputs

    loop_thread, encoded_on, salts, outputs = serve(llm, body)
    assert encoded_on and loop_thread not in encoded_on and salts == ["tenant"]
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 2
