"""`jpaged serve` across processes: process 0 leads (HTTP, tokenizer, scheduler), the others follow.

    # process 0: serves HTTP on --port
    jpaged serve --model M --coordinator-address host0:7000 --num-processes 2 --process-id 0
    # process 1 (another host, or the same one): the same flags but its id; opens no port
    jpaged serve --model M --coordinator-address host0:7000 --num-processes 2 --process-id 1

Every process needs the run's shared secret, --plan-secret-file or $JPAGED_PLAN_SECRET (at least
16 bytes, the same on every process): without one a multi-process run is refused at start-up.

Start-up, on every process: the plan channel joins first (jpaged.executors.plan_channel, on the
coordinator's address at --plan-port, default its port + 1). Each connection proves it holds the
secret (HMAC challenge-response, both ways) before any config or plan crosses it; each follower then
sends its engine config and process 0 refuses one that differs, naming the field, before any JAX
work (process 0 keeps waiting for the right one, and names the refusal if it never comes); a
follower that cannot reach process 0 within --join-timeout fails naming the address. Then the real executor joins
jax.distributed and its mesh (model.tensor_parallel_size) spans every process's devices. Process 0
warms up before serving (the server's warm-up, jpaged.entrypoints.serve.state): its steps reach every process
through the channel, so all of them compile the first step shapes before a client waits, and no
process compiles while another waits in a collective (jax#40831).

Serving: process 0's engine runs a BroadcastExecutor (jpaged.executors.remote): each step's plan
goes to every follower, then runs here; followers execute the plans in order and acknowledge them.

Failure: when the channel loses a follower (its connection closes, it reports an error, or it stays
silent or leaves a step unfinished for --follower-timeout seconds, --compile-timeout for a step of a
shape not run before), process 0's engine is failed
from the channel's thread: in-flight requests end with the error, new ones get 503 and /health
answers 503. Process 0 keeps answering HTTP (its step loop may be stuck in a collective that never
completes); restart every process to recover. A follower whose process 0 goes away exits 1.
"""

from __future__ import annotations

import argparse
import atexit
import logging

from jpaged.config import EngineConfig, config_to_dict
from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.engine_args import engine_config
from jpaged.executors.jax import JaxExecutor
from jpaged.executors.plan_channel import PlanClient, PlanServer
from jpaged.executors.plan_link import plan_secret
from jpaged.executors.remote import BroadcastExecutor
from jpaged.executors.remote import follow as follow_plans

log = logging.getLogger(__name__)


def _plan_address(args: argparse.Namespace) -> tuple[str, int]:
    """(host, port) of process 0's plan channel; ValueError naming the flag that is wrong."""
    host, _, port = (args.coordinator_address or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--coordinator-address: must be host:port of process 0 when --num-processes is "
                         f"{args.num_processes}, got {args.coordinator_address!r}")
    plan_port = args.plan_port if args.plan_port is not None else int(port) + 1
    if not 0 < plan_port < 65536:
        raise ValueError(f"--plan-port: must be in [1, 65535], got {plan_port}")
    return host, plan_port


def _config(args: argparse.Namespace, engine_args: dict) -> EngineConfig:
    """This process's engine config: --config and the engine flags, with its place in the run (the
    multi-process flags are among `engine_args`). Every process's pool must have the same block
    count: one sized from each process's free memory might not, so the run needs --num-blocks or
    --kv-cache-memory-bytes."""
    config = engine_config(args.model, args.config, **engine_args)
    if config.cache.num_blocks is None and config.cache.kv_cache_memory_bytes is None:
        raise ValueError(f"cache.num_blocks: a run of {args.num_processes} processes needs the same pool on each; "
                         f"give --num-blocks or --kv-cache-memory-bytes (not a fraction of each one's memory)")
    return config


def lead(args: argparse.Namespace, engine_args: dict) -> AsyncLLMEngine:
    """Process 0: waits for the followers, builds the engine on a BroadcastExecutor; returns it
    (`jpaged serve` warms it up and serves it). Its failure hooks are wired to the channel."""
    config = _config(args, engine_args)
    host, plan_port = _plan_address(args)
    secret = plan_secret(args.plan_secret_file)
    log.info("waiting for %d followers on %s:%d", args.num_processes - 1, host, plan_port)
    channel = PlanServer(host, plan_port, args.num_processes, config_to_dict(config), secret=secret,
                         timeout=args.follower_timeout, compile_timeout=args.compile_timeout,
                         join_timeout=args.join_timeout)
    executor = BroadcastExecutor(JaxExecutor(config), channel)
    # After the executor joined jax.distributed: exit handlers run last-registered first, so the
    # followers are told to stop before jax.distributed's shutdown waits for them at its barrier.
    atexit.register(channel.close)
    engine = AsyncLLMEngine.from_model(args.model, stream_interval=args.stream_interval, config=config,
                                       tokenizer=args.tokenizer, executor=executor,
                                       pinned_prefixes=args.pinned_prefixes or ())
    channel.on_failure.append(engine.fail)
    return engine


def follow(args: argparse.Namespace, engine_args: dict) -> int:
    """A follower: joins process 0, then runs its plans until it says stop. 0 after a stop, 1 when
    process 0 went away or a step failed here; raises ValueError / OSError (exit 2) at start-up."""
    config = _config(args, engine_args)
    host, plan_port = _plan_address(args)
    secret = plan_secret(args.plan_secret_file)
    try:
        channel = PlanClient(host, plan_port, args.process_id, config_to_dict(config), secret=secret,
                             join_timeout=args.join_timeout)
    except ConnectionError as exc:
        raise ConnectionError(f"--coordinator-address {args.coordinator_address}: {exc}") from None
    try:
        executor = JaxExecutor(config)
        log.info("process %d of %d: following process 0", args.process_id, args.num_processes)
        steps = follow_plans(executor, channel)
    except Exception:
        log.exception("process %d stops", args.process_id)
        return 1
    finally:
        channel.close()
    log.info("process 0 said stop after %d steps", steps)
    return 0
