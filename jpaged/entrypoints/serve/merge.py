"""Several request streams read as one: a completion with a list of prompts is one response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from jpaged.core.outputs import RequestOutput


def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several request streams as they come; closing it closes them all."""
    if len(streams) == 1:
        return _tagged(streams[0])
    return _merged(streams)


async def _tagged(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for output in stream:
            yield 0, output
    finally:
        await stream.aclose()


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            await stream.aclose()
