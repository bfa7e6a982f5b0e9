"""Every committed config loads under the strict loader (duplicate keys, YAML 1.2 floats, NaN and
range checks included) into its experiment's config dataclass. The bad cases are rows of
tests/engine/test_engine_bad_input.py."""

import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

from jpaged.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
# Config files named after a variant of an experiment: configs/<experiment>_<variant>.yaml.
VARIANT_OF = {"kernel_bench_block_sizes": "kernel_bench", "kernel_bench_gpu_check": "kernel_bench",
              "cpu_vs_vllm_bf16": "cpu_vs_vllm", "cpu_vs_vllm_bf16_pressure": "cpu_vs_vllm",
              "profile_forward_bf16": "profile_forward"}
# Experiments in a group folder, experiments/<group>/<experiment>.py; the figures are experiments/<experiment>/.
GROUP_OF = {"bench_decode": "bench", "bench_host": "bench", "dense_bench": "bench", "profile_executor": "bench",
            "profile_forward": "bench", "serve_real": "bench", "serve_vs_offline": "bench", "plan_transport": "bench",
            "bench_host_peer": "peers", "cpu_vs_vllm": "peers", "serve_vs_vllm": "peers",
            "train_lm": "lm", "train_tiny": "lm", "figure_moves": "report"}


def config_class(stem):
    name = VARIANT_OF.get(stem, "throughput" if stem.startswith("throughput") else stem)
    group = GROUP_OF.get(name)
    module = importlib.import_module(f"experiments.{group}.{name}" if group else f"experiments.{name}")
    (cls,) = [c for _, c in inspect.getmembers(module, inspect.isclass)
              if c.__module__ == module.__name__ and c.__name__.endswith("Config") and dataclasses.is_dataclass(c)]
    return cls


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_committed_config_loads(path):
    config = load_config(path, config_class(path.stem))
    assert dataclasses.is_dataclass(config)
