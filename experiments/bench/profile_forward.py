"""Where the forward step's time goes on this CPU: per compiled op, summed by part of the model.

For each case (decode batches, a prefill) the real jitted step (ModelRunner, the paged KV pool
donated) runs and then samples greedily (jpaged.executors.sampling), as JaxExecutor.execute does. After a
compile and warm-up, `steps` steps run under `jax.profiler.trace`; XLA:CPU's thunk executor
records one event per executed op (fusion, dot, YNNPACK fusion, scatter...), named by its HLO
instruction and module. Each op is attributed to a part through the `op_name` metadata of the
compiled HLO: the named scopes of jpaged/models (embed, qkv_proj, attention, out_proj, mlp,
lm_head), the write_kv kernel (kv_write) and the sampling executable (sampling); loops' own
events are left out (their bodies' ops are counted). Each case runs in each weight layout asked
for (ModelRunner's per_layer_weights: stacked and scanned, or one buffer per layer, unrolled).
Per case the result gives each part's milliseconds per step and share, the 12 most expensive
ops, and the step's wall and CPU time measured without the profiler (median over `steps`, CPU
time of all threads of this process).

Why a trace of the real step rather than timing each part in isolation: the parts are fused
together by XLA (the norm into the projection's producer, the residual adds into the dots'
consumers), and an isolated part compiles differently and sees a warm cache. Event durations are
wall time: on a loaded machine they include time descheduled, so read shares, and compare CPU
time between runs.

    python -m experiments.bench.profile_forward --config configs/profile_forward.yaml
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import logging
import os
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.paged_batch import plan_from_contexts, scattered_tables
from jpaged.config import ModelConfig
from jpaged.core.step_plan import SamplingBatch, StepPlan
from jpaged.executors.sampling import sample
from jpaged.models.checkpoint import load_params
from jpaged.models.kv_pool import init_kv_pool, storage_dtype
from jpaged.models.runner import ModelRunner

logger = logging.getLogger(__name__)

# Parts in the order they are matched against an op's op_name path (first hit wins).
PARTS = (("kv_write", "jit(write_kv)"), ("attention", "/attention/"), ("qkv_proj", "/qkv_proj/"),
         ("out_proj", "/out_proj/"), ("mlp", "/mlp/"), ("embed", "/embed/"), ("lm_head", "/lm_head/"))
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([a-z\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
CONTAINERS = ("while", "conditional", "call")  # their events span their bodies' ops


@dataclasses.dataclass(frozen=True)
class ProfileForwardConfig:
    """The model and the step shapes to profile."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-125m", attention_backend="xla"))
    decode_batches: list[int] = dataclasses.field(default_factory=lambda: [1, 16, 64])  # one decode case each
    context_len: int = 128  # tokens each decoding sequence holds (the new one included)
    prefill: list[int] = dataclasses.field(default_factory=lambda: [64, 24])  # [prompts, tokens each] of one prefill step
    block_size: int = 16
    steps: int = 8  # profiled (and timed) steps per case, after a compile and `steps` warm-up steps
    # Weight layouts to profile (ModelRunner's per_layer_weights): False = stacked and scanned.
    per_layer_weights: list[bool] = dataclasses.field(default_factory=lambda: [False, True])
    seed: int = 0
    output: str = "results/profile_forward.json"

    def __post_init__(self) -> None:
        if not self.decode_batches or min(self.decode_batches) < 1:
            raise ValueError(f"decode_batches must be a non-empty list of ints >= 1, got {self.decode_batches}")
        if len(self.prefill) != 2 or min(self.prefill) < 1:
            raise ValueError(f"prefill must be [prompts, tokens each] >= 1, got {self.prefill}")
        if not self.per_layer_weights:
            raise ValueError("per_layer_weights must list at least one layout (true/false)")
        for name in ("context_len", "block_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def op_parts(hlo_text: str) -> dict[str, str | None]:
    """Instruction name -> part of the model (None for loops and other containers) of compiled HLO."""
    parts = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, opcode = match.groups()
        op_name = _OP_NAME.search(line)
        path = (op_name.group(1) if op_name else "") + "/"
        parts[name] = None if opcode in CONTAINERS else next((p for p, key in PARTS if key in path), "other")
    return parts


def trace_events(directory: str) -> list[dict]:
    """The complete ('X') events of the perfetto trace `jax.profiler.trace` wrote under `directory`."""
    (path,) = Path(directory).rglob("*.trace.json.gz")
    with gzip.open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _greedy_batch(rows: int) -> SamplingBatch:
    zeros = np.zeros(rows, np.int32)
    return SamplingBatch(logits_rows=np.arange(rows, dtype=np.int32), temperature=np.zeros(rows, np.float32),
                         top_k=zeros, top_p=np.ones(rows, np.float32), seed=zeros.astype(np.uint32), stream=zeros,
                         position=zeros)


def profile_case(runner: ModelRunner, pool, plan: StepPlan, num_seqs: int, steps: int) -> tuple[dict, object]:
    """Times and traces `steps` steps (+ greedy sampling) of one shape; returns (case result, pool)."""
    step = runner.step
    batch = _greedy_batch(num_seqs)

    def one_step(pool):
        logits, pool = step(pool, plan)
        sample(logits, batch)  # waits for the tokens, as the executor does
        return pool

    wall, cpu = [], []
    for i in range(2 * steps + 1):  # step 0 compiles, then `steps` warm-up steps
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        pool = one_step(pool)
        if i > steps:
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
    parts = {f"jit_{runner.step_name}": op_parts(runner.lower(pool, plan).compile().as_text())}
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                pool = one_step(pool)
        events = trace_events(tmp)
    by_part: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for event in events:
        args = event.get("args", {})
        module, op = args.get("hlo_module"), args.get("hlo_op")
        if op is None:
            continue
        part = parts[module].get(op, "other") if module in parts else "sampling"
        if part is None:
            continue
        ms = event["dur"] / 1e3 / steps
        by_part[part] += ms
        by_op[f"{module}/{op} ({part})"] += ms
    total = sum(by_part.values())
    result = {
        "step_wall_ms": 1e3 * statistics.median(wall), "step_cpu_ms": 1e3 * statistics.median(cpu),
        "op_ms_total": total,
        "parts": {p: {"ms": ms, "share": ms / total} for p, ms in sorted(by_part.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"op": op, "ms": ms} for op, ms in by_op.most_common(12)],
    }
    return result, pool


def _case_plan(spec, config: ProfileForwardConfig, num_seqs: int, context_len: int,
               num_query: int) -> tuple[StepPlan, int]:
    """(an unpadded plan of `num_seqs` sequences of `context_len` tokens computing their last
    `num_query` over scattered blocks, the pool's block count)."""
    rng = np.random.default_rng(config.seed)
    blocks_per_seq = -(-context_len // config.block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    tables = scattered_tables(rng, [blocks_per_seq] * num_seqs, num_blocks)
    contexts = [rng.integers(1, spec.vocab_size, context_len).tolist() for _ in range(num_seqs)]
    shape = (num_seqs * num_query, num_seqs, blocks_per_seq)
    return plan_from_contexts(contexts, [num_query] * num_seqs, tables, config.block_size, shape=shape), num_blocks


def run(config: ProfileForwardConfig) -> dict:
    """Profiles every case; writes and returns {"cases": [...], "provenance": ...}."""
    spec, params = load_params(config.model)
    dtype = params["embed"]["embedding"].dtype
    shapes = [("decode", b, config.context_len, 1) for b in config.decode_batches]
    shapes.append(("prefill", config.prefill[0], config.prefill[1], config.prefill[1]))
    cases = []
    for per_layer in config.per_layer_weights:
        layout = "per_layer" if per_layer else "stacked"
        for kind, num_seqs, context_len, num_query in shapes:
            plan, num_blocks = _case_plan(spec, config, num_seqs, context_len, num_query)
            runner = ModelRunner(spec, params, block_size=config.block_size,
                                 attention_backend=config.model.attention_backend, per_layer_weights=per_layer)
            # Stored as the engine stores it (bfloat16 as its bits on CPU, kv_pool.storage_dtype).
            pool = init_kv_pool(spec, num_blocks, config.block_size,
                                storage_dtype(dtype, attention_backend=runner.backend))  # "auto" resolved
            result, _ = profile_case(runner, pool, plan, num_seqs, config.steps)
            case = {"layout": layout, "kind": kind, "num_seqs": num_seqs, "context_len": context_len,
                    "query_tokens": num_seqs * num_query, **result, "load_average": os.getloadavg()}
            cases.append(case)
            shares = "  ".join(f"{p} {v['share']:.0%}" for p, v in case["parts"].items())
            print(f"{layout:<9} {kind:<8} seqs {num_seqs:<3} ctx {context_len:<4} step wall "
                  f"{case['step_wall_ms']:8.1f} ms cpu {case['step_cpu_ms']:8.1f} ms | {shares}", flush=True)
    result = {"model": spec.name, "dtype": str(dtype), "cpu_count": os.cpu_count(),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "cases": cases,
              "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], ProfileForwardConfig, run, "configs/profile_forward.yaml")
