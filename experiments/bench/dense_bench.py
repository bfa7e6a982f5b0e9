"""The native CPU dense kernel against XLA's dot: interleaved timings of the same products.

For each (rows M, in K, out N) and weight dtype, x [M, K] . W [K, N] runs through
`pallas_kernels.native_dense_cpu.matmul` on the packed W and through the `jnp.dot` XLA:CPU would
run for `layers.linear` (x rounded to W's dtype, float32 accumulation), alternately, in `rounds`
rounds of `reps` calls each. It reports process CPU milliseconds per call (steadier than wall
time on a shared machine) and wall milliseconds, their medians over rounds and the per-round
ratio XLA / native (> 1: the native kernel is faster), and checks that both agree to float32
rounding. The host CPU (and so the kernel path: AMX, AVX-512 BF16, AVX2) is in the provenance.

    python -m experiments.bench.dense_bench --config configs/dense_bench.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from pallas_kernels import native_dense_cpu

logger = logging.getLogger(__name__)

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class DenseBenchConfig:
    """The products to time and how."""

    # [M, K, N]: decode-step rows of OPT-125m's MLP, its tied LM head, and a LLaMA-7B projection
    shapes: list[list[int]] = dataclasses.field(default_factory=lambda: [
        [8, 768, 3072], [64, 768, 3072], [8, 768, 50272], [32, 4096, 4096]])
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["float32", "bfloat16"])  # weight dtypes
    reps: int = 10  # calls per timing
    rounds: int = 5  # interleaved rounds: native, XLA, native, ...
    seed: int = 0
    output: str = "results/dense_bench.json"  # relative to the repo root

    def __post_init__(self) -> None:
        if not self.shapes or any(len(s) != 3 or min(s) < 1 for s in self.shapes):
            raise ValueError(f"shapes: a non-empty list of [M, K, N] with every size >= 1, got {self.shapes}")
        if not self.dtypes or any(d not in DTYPES for d in self.dtypes):
            raise ValueError(f"dtypes: a non-empty list of {list(DTYPES)}, got {self.dtypes}")
        if self.reps < 1 or self.rounds < 1:
            raise ValueError(f"reps and rounds must be >= 1, got {self.reps}, {self.rounds}")


def _timed(fn, args, reps: int) -> tuple[float, float]:
    """(process CPU ms, wall ms) per call of `fn(*args)`, averaged over `reps` calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn(*args).block_until_ready()
    return (time.process_time() - cpu) / reps * 1e3, (time.perf_counter() - wall) / reps * 1e3


def bench_one(m: int, k: int, n: int, dtype: str, reps: int, rounds: int, rng: np.random.Generator) -> dict:
    """Times one product both ways; returns its row of the results."""
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) / np.sqrt(k)).astype(DTYPES[dtype])
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    packed = native_dense_cpu.pack(w)
    native = jax.jit(lambda x, p: native_dense_cpu.matmul(x, p, out_features=n))
    xla = jax.jit(lambda x, w: jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32))
    got, want = np.asarray(native(x, packed)), np.asarray(xla(x, w))  # (also compiles both)
    max_err = float(np.abs(got - want).max())
    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):  # only the summation order differs
        raise AssertionError(f"{dtype} {m}x{k}x{n}: native and XLA differ by up to {max_err}")
    times: dict[str, list[tuple[float, float]]] = {"native": [], "xla": []}
    for _ in range(rounds):
        times["native"].append(_timed(native, (x, packed), reps))
        times["xla"].append(_timed(xla, (x, w), reps))
    ratios = [x_cpu / n_cpu for (n_cpu, _), (x_cpu, _) in zip(times["native"], times["xla"])]
    row = {"m": m, "k": k, "n": n, "dtype": dtype, "max_abs_diff": max_err,
           "cpu_ratio_xla_over_native": float(np.median(ratios)), "cpu_ratios": ratios}
    for name, runs in times.items():
        row[f"{name}_cpu_ms"] = float(np.median([c for c, _ in runs]))
        row[f"{name}_wall_ms"] = float(np.median([w for _, w in runs]))
    return row


def run(config: DenseBenchConfig) -> dict:
    """Times every shape and dtype; returns (and writes) the rows."""
    reason = native_dense_cpu.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the native CPU dense kernel is unavailable here: {reason}")
    rng = np.random.default_rng(config.seed)
    rows = []
    for dtype in config.dtypes:
        for m, k, n in config.shapes:
            row = bench_one(m, k, n, dtype, config.reps, config.rounds, rng)
            rows.append(row)
            print(f"{dtype:<9} {m}x{k}x{n}: native {row['native_cpu_ms']:.3f} ms, XLA {row['xla_cpu_ms']:.3f} ms "
                  f"CPU per call; XLA / native {row['cpu_ratio_xla_over_native']:.2f}")
    result = {"rows": rows, "load_average": os.getloadavg(),
              "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], DenseBenchConfig, run, "configs/dense_bench.yaml")
