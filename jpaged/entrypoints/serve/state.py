"""The server's life as one state it owns: starting (warming up), ready, draining, stopped.

/health answers 200 only when ready (and the engine's step loop is alive), 503 with the state
otherwise; generation routes refuse with 503 unless ready. The warm-up is a coroutine function
given to ServerState (`warm_up_grid`: every program; `warm_up_smallest_steps`: two steps); the
state turns ready when it returns. A stop during the warm-up ends it after the program compiling
now (the grid checks the state's `stopping` event between programs), so the process exits
without compiling the rest. On SIGTERM or SIGINT the server drains:
it stops taking requests, lets open ones finish for at most `shutdown_timeout` seconds, then
aborts what remains (each stream ends with finish reason "abort"; its blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Awaitable, Callable

from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.serve.errors import RequestError
from jpaged.executors.warmup import WarmUpStopped, compile_grid

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STARTING = "starting"  # the engine compiles its first steps (warm-up); requests get 503
    READY = "ready"
    DRAINING = "draining"  # shutting down: open requests finish, new ones get 503
    STOPPED = "stopped"


WarmUp = Callable[[AsyncLLMEngine, threading.Event], Awaitable[None]]  # (engine, stopping)


async def warm_up_smallest_steps(engine: AsyncLLMEngine, stopping: threading.Event) -> None:
    """Compiles the smallest prefill and decode steps through the engine's own step loop (a request
    like any other; a stop aborts it with the others); other shapes still compile on first use."""
    start = time.perf_counter()
    async for _ in engine.generate([1] * 8, SamplingParams(max_tokens=2, ignore_eos=True), "warm-up"):
        pass
    log.info("warm-up done in %.1f s: the smallest prefill and decode steps are compiled", time.perf_counter() - start)


async def warm_up_grid(engine: AsyncLLMEngine, stopping: threading.Event) -> None:
    """Compiles every program the engine can run (jpaged.executors.warmup.compile_grid) in a worker
    thread, the event loop answering /health (503) meanwhile; `stopping` set ends it after the
    program compiling now. It runs on the executor's pool directly: safe because no request runs
    before the state is ready (generation routes refuse), so the engine's step loop has nothing to step."""
    try:
        report = await asyncio.to_thread(compile_grid, engine.engine.executor, engine.engine.config, stop=stopping)
    except WarmUpStopped:  # the server is shutting down (compile_grid logged how far it got)
        return
    log.info("warm-up done: %d programs in %.1f s (%.1f s CPU)", report["num_programs"], report["seconds"],
             report["cpu_seconds"])


class ServerState:
    """Readiness and draining of one served engine."""

    def __init__(self, engine: AsyncLLMEngine, warm_up: WarmUp | None = warm_up_smallest_steps,
                 shutdown_timeout: float = 5.0):
        """`warm_up`: awaited at start, before the server turns ready (None: ready at once);
        `shutdown_timeout`: seconds open requests get to finish when the server is stopped."""
        self.engine = engine
        self.phase = Phase.STARTING if warm_up is not None else Phase.READY
        self.warm_up = warm_up
        self.shutdown_timeout = shutdown_timeout
        self.ready = asyncio.Event()
        self.stopping = threading.Event()  # set at the first stop signal: the warm-up ends early
        if warm_up is None:
            self.ready.set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event loop the server runs on (drains start on it)."""
        self._loop = loop

    @property
    def is_healthy(self) -> bool:
        """True when ready and the engine's step loop is alive."""
        return self.phase is Phase.READY and not self.engine.is_dead

    def describe(self) -> str:
        """The state for /health's 503 body."""
        if self.engine.is_dead:
            return f"engine dead: {self.engine.error}"
        return self.phase.value

    def check_accepting(self) -> None:
        """RequestError (503) unless generation requests are taken now."""
        if self.phase is not Phase.READY:
            why = "is warming up (compiling its first steps)" if self.phase is Phase.STARTING else "is shutting down"
            raise RequestError(f"the server {why}: retry later", None, 503, "service_unavailable")

    async def start(self, observe: Callable[[], None]) -> None:
        """Awaits the warm-up, then calls `observe()` (metrics start after warm-up, which is no
        client's work) and turns ready, unless a stop came meanwhile."""
        if self.warm_up is not None:
            await self.warm_up(self.engine, self.stopping)
        if self.stopping.is_set():
            return
        observe()
        if self.phase is Phase.STARTING:
            self.phase = Phase.READY
        self.ready.set()

    def begin_drain(self) -> None:
        """Starts draining; callable from a signal handler (it only schedules the drain on the loop)."""
        if self._loop is not None and self._drain is None:
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self.stopping.set()
        if self._drain is None:
            self._drain = self._loop.create_task(self.drain())

    def stop(self) -> None:
        """At the app's shutdown: aborts whatever is still open, stops the engine's step loop (the
        aborts are applied first: their blocks are freed) and logs the blocks left in use."""
        self.phase = Phase.STOPPED
        self.stopping.set()
        if self._drain is not None:
            self._drain.cancel()
        aborted = self.engine.abort_all("the server is shutting down")
        self.engine.shutdown()
        stats = self.engine.engine.kv_stats()
        log.info("shutdown: %d request(s) aborted at exit; KV blocks in use: %d of %d", aborted,
                 stats["num_total_blocks"] - stats["num_free_blocks"], stats["num_total_blocks"])

    async def drain(self) -> int:
        """Stops taking requests, waits up to `shutdown_timeout` s for the open ones, aborts the rest;
        how many were aborted."""
        self.phase = Phase.DRAINING
        deadline = time.monotonic() + self.shutdown_timeout
        while self.engine.num_open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = self.engine.abort_all("the server is shutting down")
        if aborted:
            log.warning("shutdown: %d request(s) still open after %.1f s: aborted", aborted, self.shutdown_timeout)
        return aborted
