"""`jpaged serve`: build the engine, serve it with uvicorn, warm up, drain on SIGINT / SIGTERM.

The server listens at once; /health answers 503 until the warm-up is done: by default every
program the engine can run (jpaged.executors.warmup, with the disk cache under $JPAGED_CACHE_DIR),
or with `--warmup smallest` the smallest prefill and decode steps only. Shutdown (SIGINT or SIGTERM):
uvicorn stops accepting connections, open requests get `--shutdown-timeout` seconds to finish,
then the rest are aborted (their streams end with finish reason "abort", their blocks are freed);
a client that holds a stream open without reading is cut off a moment later; the engine's step
loop stops and the process exits 0. A stop during start-up exits 0 as well: while the weights load
or process 0 waits for the other processes to join (the stop signal interrupts either), and during
the warm-up (the grid stops after the program compiling now).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType

import uvicorn

from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.engine_flags import engine_args_from
from jpaged.entrypoints.serve.app import build_app
from jpaged.entrypoints.serve.security import Exposure
from jpaged.entrypoints.serve.state import ServerState, warm_up_grid, warm_up_smallest_steps
from jpaged.executors.warmup import enable_compilation_cache

log = logging.getLogger(__name__)

# After the drain's deadline, aborted streams get this long to send their last chunk before uvicorn
# cancels what is still writing (a client that never reads).
ABORT_GRACE_S = 2.0


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app's state to drain when a stop signal comes."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.begin_drain()
        super().handle_exit(sig, frame)


def run(args: argparse.Namespace) -> int:
    """Serves until interrupted; 0 on a clean shutdown, 2 when the model or config is refused."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not args.shutdown_timeout >= 0:
        print(f"jpaged serve: --shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}", file=sys.stderr)
        return 2
    try:
        exposure = Exposure.from_args(args)  # keys, TLS, CORS, limits: refused before the engine is built
    except ValueError as exc:
        print(f"jpaged serve: {exc}", file=sys.stderr)
        return 2
    engine_args = engine_args_from(args)  # the engine flags given (the multi-process flags among them)
    # From here on a stop signal raises _Stopped wherever the main thread is (loading weights,
    # waiting for the other processes to join); uvicorn installs its own handlers while it serves,
    # restores these and re-raises the signal once its graceful shutdown is done.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    try:
        return _serve(args, engine_args, exposure)
    except _Stopped as stop:
        log.info("stopped by %s", stop)
        return 0


def _serve(args: argparse.Namespace, engine_args: dict, exposure: Exposure) -> int:
    """Builds the engine and serves it until a stop signal raises _Stopped; 2 when the model or
    config is refused."""
    enable_compilation_cache()  # before the engine compiles anything
    try:
        if args.num_processes > 1:  # one scheduler here, the other processes follow (jpaged.entrypoints.multihost)
            from jpaged.entrypoints import multihost

            if args.process_id != 0:
                return multihost.follow(args, engine_args)
            engine = multihost.lead(args, engine_args)
        else:
            engine = AsyncLLMEngine.from_model(args.model, stream_interval=args.stream_interval, config=args.config,
                                               tokenizer=args.tokenizer, pinned_prefixes=args.pinned_prefixes or (),
                                               **engine_args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"jpaged serve: {exc}", file=sys.stderr)
        return 2
    _raise_if_stopped()
    name = args.served_model_name or args.model
    # A multi-process run always warms up through its steps, which reach every process, which then
    # compile together before serving, so no collective waits on another process's compile
    # (jax#40831); the grid runs on this process's executor alone, so such a run warms up its
    # smallest steps instead.
    warmup = "smallest" if args.num_processes > 1 else args.warmup
    warm_up = {"grid": warm_up_grid, "smallest": warm_up_smallest_steps, "none": None}[warmup]
    state = ServerState(engine, warm_up=warm_up,
                        shutdown_timeout=args.shutdown_timeout)
    app = build_app(engine, name, state, stream_interval=args.stream_interval, exposure=exposure)
    log.info("serving %s (max_model_len %d) on %s://%s:%d%s", name, engine.engine.config.scheduler.max_model_len,
             exposure.scheme, args.host, args.port,
             f"; {len(exposure.api_keys)} API key(s) required outside /health, /metrics, /version"
             if exposure.api_keys else "")
    _raise_if_stopped()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S,
                            **exposure.uvicorn_options())
    _Server(config, state).run()
    return 0


class _Stopped(BaseException):
    """Raised by a stop signal outside uvicorn's serving (start-up), or re-raised by uvicorn once its
    graceful shutdown is done. A BaseException, as KeyboardInterrupt: no `except Exception` on the
    way (a failed load turned into an error message) takes it for a failure."""


# The stop signal received during start-up, if any. Raising from the handler is not enough: a
# signal that lands while the main thread runs a garbage-collection callback (jax registers one)
# raises inside it, and Python ignores an exception from such a callback; so the signal is also
# remembered and checked before serving starts (`_raise_if_stopped`).
_stop_signal: list[str] = []


def _stopped(signum, frame) -> None:
    _stop_signal.append(signal.Signals(signum).name)
    raise _Stopped(_stop_signal[-1])


def _raise_if_stopped() -> None:
    """_Stopped if a stop signal came during start-up (one whose exception may have been swallowed)."""
    if _stop_signal:
        raise _Stopped(_stop_signal[-1])
