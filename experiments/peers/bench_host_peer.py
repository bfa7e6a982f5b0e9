"""jpaged's host overhead against a peer, nano-vllm's scheduler: interleaved runs, fresh processes, ratios.

For each block size, `rounds` rounds run in turn, each in a fresh process: jpaged under each
policy (the bench_host engine: its cache, scheduler and trace) and nano-vllm's Scheduler +
BlockManager (`peer_path`, outside this repository: ../shared/bench, see its README) on the same
requests (the same prompts and output lengths, all at time 0, a constant sampled token). Each
process times only its serving loop, in wall and CPU seconds. nano-vllm does less per step than
jpaged (it builds no step tensors, never swaps, always recomputes, prefix-caches by hashing), so it
is a floor to beat. Ratios are jpaged / nano-vllm per round, in CPU time per sequence-step; the
summary is their median over rounds.

    python -m experiments.peers.bench_host_peer --config configs/bench_host_peer.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from experiments.bench.bench_host import BenchHostConfig, serve, trace_prompts
from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.config import config_from_dict, config_to_dict

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchHostPeerConfig:
    """The bench_host trace and engine, the block sizes, and the interleaving."""

    bench: BenchHostConfig = dataclasses.field(default_factory=BenchHostConfig)  # trace, cache, scheduler, policies
    block_sizes: list[int] = dataclasses.field(default_factory=lambda: [16, 256])  # KV block sizes compared
    kv_slots: int = 15_728  # KV slots at every block size (OPT-13B on one A100-40GB)
    rounds: int = 3  # interleaved rounds: jpaged (each policy), nano-vllm, again ...
    peer_path: str = "../shared/bench"  # folder holding the `nanovllm` package, relative to the repo root
    output: str = "results/bench_host_peer.json"  # results JSON, relative to the repo root

    def __post_init__(self) -> None:
        if self.rounds < 1 or not self.block_sizes or self.kv_slots < 1:
            raise ValueError(f"rounds >= 1, block_sizes non-empty and kv_slots >= 1 required, got "
                             f"{self.rounds}, {self.block_sizes}, {self.kv_slots}")


def bench_at(config: BenchHostPeerConfig, block_size: int) -> BenchHostConfig:
    """The bench_host config at `block_size`, with the same KV slots."""
    cache = dataclasses.replace(config.bench.cache, block_size=block_size,
                                num_blocks=config.kv_slots // block_size + 1,
                                num_host_blocks=config.kv_slots // block_size + 1)
    return dataclasses.replace(config.bench, cache=cache)


def _serve_jpaged(bench: BenchHostConfig, policy: str, trace: dict) -> dict:
    return serve(bench, policy, trace["prompts"], trace["outputs"], show_progress=False)


def _serve_nanovllm(bench: BenchHostConfig, peer_path: str, trace: dict) -> dict:
    sys.path.insert(0, peer_path)
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams

    block_size = bench.cache.block_size
    Sequence.block_size = block_size
    scheduler = Scheduler(SimpleNamespace(
        max_num_seqs=bench.scheduler.max_num_seqs, max_num_batched_tokens=bench.scheduler.max_num_batched_tokens,
        eos=-1, kvcache_block_size=block_size, num_kvcache_blocks=bench.cache.num_blocks - 1))
    for prompt, output_len in zip(trace["prompts"], trace["outputs"]):
        # nano-vllm refuses temperature 0; sampling never runs here, so the value is immaterial.
        scheduler.add(Sequence(prompt, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)))
    steps = seq_steps = 0
    gc.collect()
    gc.freeze()  # as jpaged's serving loop does (bench_host.serve): the same heap treatment on both sides
    wall, cpu = time.perf_counter(), time.process_time()
    while not scheduler.is_finished():
        seqs, is_prefill = scheduler.schedule()
        scheduler.postprocess(seqs, [7] * len(seqs), is_prefill)
        steps += 1
        seq_steps += len(seqs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gc.unfreeze()
    return {"steps": steps, "seq_steps": seq_steps, "wall_s": wall, "cpu_s": cpu,
            "us_per_seq_step": wall / seq_steps * 1e6, "cpu_us_per_seq_step": cpu / seq_steps * 1e6}


def _run_worker(engine: str, policy: str | None, bench: BenchHostConfig, peer_path: str, trace_file: Path) -> dict:
    """One timed run in a fresh process; returns its JSON line."""
    cmd = [sys.executable, "-m", "experiments.peers.bench_host_peer", "--worker", engine, "--trace", str(trace_file),
           "--bench", json.dumps(config_to_dict(bench)), "--peer-path", peer_path] + (["--policy", policy] if policy else [])
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "0"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(config: BenchHostPeerConfig) -> dict:
    """Interleaved rounds per block size; writes and returns the runs and the median ratios."""
    peer_path = str((REPO_ROOT / config.peer_path).resolve())
    if not (Path(peer_path) / "nanovllm").is_dir():
        raise FileNotFoundError(f"peer_path: no nanovllm package in {peer_path} (see ../shared/bench/README.md)")
    runs, summary = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for block_size in config.block_sizes:
            bench = bench_at(config, block_size)
            prompts, outputs = trace_prompts(bench)
            trace_file = Path(tmp) / f"trace_{block_size}.json"
            trace_file.write_text(json.dumps({"prompts": prompts, "outputs": outputs}))
            for r in range(config.rounds):
                peer = _run_worker("nanovllm", None, bench, peer_path, trace_file)
                runs.append({"block_size": block_size, "round": r, "engine": "nanovllm", **peer})
                for policy in bench.policies:
                    ours = _run_worker("jpaged", policy, bench, peer_path, trace_file)
                    runs.append({"block_size": block_size, "round": r, "engine": f"jpaged-{policy}", **ours,
                                 "cpu_ratio": ours["cpu_us_per_seq_step"] / peer["cpu_us_per_seq_step"],
                                 "wall_ratio": ours["us_per_seq_step"] / peer["us_per_seq_step"]})
                    logger.info("block %d round %d %s: %.3f us/seq-step cpu (nano-vllm %.3f)", block_size, r,
                                policy, ours["cpu_us_per_seq_step"], peer["cpu_us_per_seq_step"])
            for engine in ["nanovllm"] + [f"jpaged-{p}" for p in bench.policies]:
                mine = [x for x in runs if x["block_size"] == block_size and x["engine"] == engine]
                row = {"cpu_us_per_seq_step": float(np.median([x["cpu_us_per_seq_step"] for x in mine])),
                       "us_per_seq_step": float(np.median([x["us_per_seq_step"] for x in mine]))}
                if engine != "nanovllm":
                    row |= {"cpu_ratio": float(np.median([x["cpu_ratio"] for x in mine])),
                            "wall_ratio": float(np.median([x["wall_ratio"] for x in mine]))}
                summary[f"{engine}@{block_size}"] = row
    result = {"summary": summary, "runs": runs, "load_average": os.getloadavg(),
              "provenance": provenance(config, seed=config.bench.seed, device="host (no model)")}
    for key, row in summary.items():
        ratio = f"  ratio jpaged/nano-vllm: cpu {row['cpu_ratio']:.3f}, wall {row['wall_ratio']:.3f}" if "cpu_ratio" in row else ""
        print(f"{key:<22} {row['cpu_us_per_seq_step']:.3f} us cpu / seq-step ({row['us_per_seq_step']:.3f} wall){ratio}")
    write_json(REPO_ROOT / config.output, result)
    return result


def _worker() -> None:
    parser = argparse.ArgumentParser(description="one timed run (internal)")
    parser.add_argument("--worker", choices=["jpaged", "nanovllm"], required=True)
    parser.add_argument("--policy")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--bench", required=True)
    parser.add_argument("--peer-path", required=True)
    args = parser.parse_args()
    bench = config_from_dict(BenchHostConfig, json.loads(args.bench), "--bench")
    trace = json.loads(Path(args.trace).read_text())
    out = (_serve_jpaged(bench, args.policy, trace) if args.worker == "jpaged"
           else _serve_nanovllm(bench, args.peer_path, trace))
    print(json.dumps(out))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if "--worker" in sys.argv:
        _worker()
    else:
        main(__doc__.splitlines()[0], BenchHostPeerConfig, run, "configs/bench_host_peer.yaml")
