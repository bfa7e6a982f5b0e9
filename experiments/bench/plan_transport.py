"""Per-step cost of sending a StepPlan from process 0 to a follower: the plan channel (TCP) vs a JAX
collective broadcast (issue 33 item 1: the transport is chosen by this measurement).

Two processes on loopback join with jax.distributed (one CPU device each). For each plan shape
(a decode batch, a prompt batch) process 0 sends the same encoded plan (jpaged.executors.plan_wire)
`steps` times after `warmup_steps`:
- socket: one PLAN frame over a TCP connection; the follower receives it, decodes it and answers
  with an ACK frame, which process 0 waits for: a round trip, so the one-way cost is at most this.
- collective: `multihost_utils.broadcast_one_to_all` of the byte length, then of the bytes padded
  to a power of two (a collective needs the same shape on every process); the follower decodes.
  A collective ends on both sides together, so one iteration is the per-step cost.
Reported per transport and shape: median and p90 wall microseconds per step on process 0, CPU
microseconds per step on each process (all threads), and the message size.

    python -m experiments.bench.plan_transport --config configs/plan_transport.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import socket
import statistics
import time

import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.paged_batch import plan_from_contexts
from jpaged.core.padding import bucket
from jpaged.core.step_plan import SamplingBatch, StepPlan
from jpaged.executors.plan_link import ACK, PLAN, recv_frame, send_frame
from jpaged.executors.plan_wire import RemoteRows, decode_plan, encode_plan

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanTransportConfig:
    """Plan shapes and repetitions."""

    block_size: int = 16
    decode_seqs: int = 256  # a decode step of this many sequences ...
    decode_context: int = 1024  # ... each with this many tokens of context (block tables [S, context / block])
    prefill_seqs: int = 8  # a prompt step of this many sequences ...
    prefill_len: int = 256  # ... of this many tokens each
    steps: int = 300
    warmup_steps: int = 30
    output: str = "results/plan_transport.json"

    def __post_init__(self) -> None:
        for name in ("block_size", "decode_seqs", "decode_context", "prefill_seqs", "prefill_len", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def make_plan(num_seqs: int, context: int, query: int, block_size: int) -> StepPlan:
    """A plan of `num_seqs` sequences computing their last `query` of `context` tokens, all sampling."""
    rng = np.random.default_rng(0)
    blocks = -(-context // block_size)
    tables = [list(rng.permutation(num_seqs * blocks)[:blocks] + 1) for _ in range(num_seqs)]
    contexts = [list(rng.integers(1, 32000, context)) for _ in range(num_seqs)]
    plan = plan_from_contexts(contexts, [query] * num_seqs, tables, block_size)
    rows = np.arange(num_seqs, dtype=np.int32)
    plan.sampling = RemoteRows(SamplingBatch(
        logits_rows=rows, temperature=np.full(num_seqs, 0.7, np.float32), top_k=np.zeros(num_seqs, np.int32),
        top_p=np.ones(num_seqs, np.float32), seed=rows.astype(np.uint32), stream=rows,
        position=np.full(num_seqs, context, np.int32)))
    return plan


def _socket_loop(rank: int, sock: socket.socket, plan: StepPlan, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        if rank == 0:
            send_frame(sock, PLAN, *encode_plan(plan))
            recv_frame(sock)
        else:
            _, payload = recv_frame(sock)
            decode_plan(payload)
            send_frame(sock, ACK, b"")
        times.append(time.perf_counter() - start)
    return times


def _collective_loop(rank: int, plan: StepPlan, count: int) -> list[float]:
    from jax.experimental import multihost_utils

    times = []
    for _ in range(count):
        start = time.perf_counter()
        data = np.frombuffer(b"".join(bytes(b) for b in encode_plan(plan)), np.uint8) if rank == 0 else None
        size = int(multihost_utils.broadcast_one_to_all(np.int64(len(data) if rank == 0 else 0)))
        padded = np.zeros(bucket(size), np.uint8)
        if rank == 0:
            padded[:size] = data
        received = np.asarray(multihost_utils.broadcast_one_to_all(padded))
        if rank != 0:
            decode_plan(received[:size].tobytes())
        times.append(time.perf_counter() - start)
    return times


def _child(rank: int, ports: tuple[int, int], config: PlanTransportConfig, results) -> None:
    """One process: joins jax.distributed and the socket, runs every (transport, shape), reports."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    import jax

    jax.distributed.initialize(f"127.0.0.1:{ports[0]}", num_processes=2, process_id=rank)
    if rank == 0:
        with socket.create_server(("127.0.0.1", ports[1])) as listener:
            sock, _ = listener.accept()
    else:
        sock = socket.create_connection(("127.0.0.1", ports[1]), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    shapes = {"decode": make_plan(config.decode_seqs, config.decode_context, 1, config.block_size),
              "prefill": make_plan(config.prefill_seqs, config.prefill_len, config.prefill_len, config.block_size)}
    out = {}
    for shape, plan in shapes.items():
        for transport in ("socket", "collective"):
            def loop(count, transport=transport, plan=plan):
                if transport == "socket":
                    return _socket_loop(rank, sock, plan, count)
                return _collective_loop(rank, plan, count)

            loop(config.warmup_steps)
            cpu = time.process_time()
            times = loop(config.steps)
            cpu = time.process_time() - cpu
            out[f"{transport}/{shape}"] = {
                "median_us": statistics.median(times) * 1e6,
                "p90_us": float(np.percentile(times, 90)) * 1e6,
                "cpu_us_per_step": cpu / config.steps * 1e6,
                "message_bytes": sum(memoryview(b).nbytes for b in encode_plan(plan))}
    sock.close()
    results.put((rank, out))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(config: PlanTransportConfig) -> dict:
    """Runs both processes; writes and returns {transport/shape: process 0's numbers + the follower's CPU}."""
    context = multiprocessing.get_context("spawn")  # fresh interpreters: jax initialises in each
    results = context.Queue()
    ports = (_free_port(), _free_port())
    children = [context.Process(target=_child, args=(rank, ports, config, results)) for rank in (0, 1)]
    for child in children:
        child.start()
    by_rank = dict(results.get(timeout=1800) for _ in children)
    for child in children:
        child.join(60)
    rows = {key: {**value, "follower_cpu_us_per_step": by_rank[1][key]["cpu_us_per_step"]}
            for key, value in by_rank[0].items()}
    print(f"{'transport/shape':<22}{'bytes':>10}{'median us':>12}{'p90 us':>10}{'cpu us p0':>11}{'cpu us p1':>11}")
    for key, row in rows.items():
        print(f"{key:<22}{row['message_bytes']:>10}{row['median_us']:>12.0f}{row['p90_us']:>10.0f}"
              f"{row['cpu_us_per_step']:>11.0f}{row['follower_cpu_us_per_step']:>11.0f}")
    result = {"provenance": provenance(config), "load_average": os.getloadavg(), "per_step": rows}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    main(__doc__.splitlines()[0], PlanTransportConfig, run, "configs/plan_transport.yaml")
