"""`jpaged serve`: build the engine, warm it up, serve it with uvicorn until SIGINT / SIGTERM.

Shutdown (SIGINT or SIGTERM) is uvicorn's graceful one: it stops accepting connections, lets
open requests finish, then the app's lifespan stops the engine's step loop; the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.serve.api_server import build_app

log = logging.getLogger(__name__)

# `jpaged serve` flags that are engine arguments (jpaged.entrypoints.engine_args), by their argparse dest.
ENGINE_FLAGS = ("dtype", "max_model_len", "block_size", "num_blocks", "num_host_blocks", "max_num_seqs",
                "max_num_batched_tokens", "enable_prefix_caching", "policy", "preemption_mode", "attention_backend",
                "tensor_parallel_size")


def warm_up(engine: LLMEngine) -> None:
    """Compiles the smallest prefill and decode steps before the first client waits for them."""
    engine.generate([[1] * 8], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)


def run(args: argparse.Namespace) -> int:
    """Serves until interrupted; 0 on a clean shutdown, 2 when the model or config is refused."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_args = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name) is not None}
    try:
        if args.num_processes > 1:  # one scheduler here, the other processes follow (jpaged.entrypoints.multihost)
            from jpaged.entrypoints import multihost

            if args.process_id != 0:
                return multihost.follow(args, engine_args)
            engine = multihost.lead(args, engine_args)
        else:
            engine = AsyncLLMEngine.from_model(args.model, stream_interval=args.stream_interval, config=args.config,
                                               tokenizer=args.tokenizer, **engine_args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"jpaged serve: {exc}", file=sys.stderr)
        return 2
    if not args.no_warmup or args.num_processes > 1:  # every process compiles before serving (jax#40831)
        warm_up(engine.engine)
    name = args.served_model_name or args.model
    app = build_app(engine, name)
    log.info("serving %s (max_model_len %d) on http://%s:%d", name, engine.engine.config.scheduler.max_model_len,
             args.host, args.port)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal: these handlers
    # (restored by uvicorn before it re-raises) turn that into a normal exit with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stopped)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                    access_log=not args.disable_access_log)
    except _Stopped:
        pass
    return 0


class _Stopped(Exception):
    """Raised by the re-raised stop signal once uvicorn's graceful shutdown is done."""


def _stopped(signum, frame) -> None:
    raise _Stopped(signal.Signals(signum).name)
