"""One process of a 2-process tensor-parallel run on CPU (test_multi_host.py starts two).

Usage: XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.models.parallel.multihost_worker
PROCESS_ID PORT. Each process owns 2 virtual CPU devices (the flag comes from the starting test's
environment: set here on import, it gave every later test of an importing pytest process 2 devices
when jax had not started yet, and the executable store, which needs one, stored nothing); with
tensor_parallel_size 4 the mesh spans both processes, joined by jax.distributed through the config.
Prints the greedy outputs and preemption count as one JSON line.
"""

import json
import sys

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor

DEVICES_FLAG = "--xla_force_host_platform_device_count=2"  # each worker's XLA_FLAGS

PROMPTS = [[1, 2, 3, 4, 5], list(range(1, 40)), list(range(7, 50))]


def config(tp: int, process_id: int = 0, port: int = 0) -> EngineConfig:
    """tiny-llama on a 12-block pool with swap preemption; multi-process when `port` is given."""
    hosts = {"coordinator_address": f"localhost:{port}", "num_processes": 2, "process_id": process_id} if port else {}
    return EngineConfig(
        model=ModelConfig(name="tiny-llama", attention_backend="xla", tensor_parallel_size=tp, **hosts),
        cache=CacheConfig(block_size=8, num_blocks=13, num_host_blocks=64, watermark=0.0),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=128,
                                  preemption_mode="swap"))


def serve(cfg: EngineConfig) -> dict:
    """Greedy outputs of PROMPTS and the number of preemptions."""
    engine = LLMEngine(cfg, executor=JaxExecutor(cfg))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)
    return {"outputs": [o.output_token_ids for o in outs], "preemptions": engine.kv_stats()["num_preemptions"]}


if __name__ == "__main__":
    process_id, port = int(sys.argv[1]), int(sys.argv[2])
    print(json.dumps(serve(config(4, process_id, port))), flush=True)
