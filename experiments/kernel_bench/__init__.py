"""Paged vs contiguous decode attention latency (paper Fig. 18a).

For each (batch, context length, block size) every sequence holds `context_len` tokens; the paged
cache places its blocks at a random permutation of the pool, the contiguous cache stores each
sequence in one region. On CPU it times the XLA paths (chunk-streamed jnp); on a GPU the
Pallas Triton kernels, plus a measured device-to-device copy as the bandwidth ceiling and JAX's own
`jax.experimental.pallas.ops.gpu.paged_attention` at the same shapes as a peer.

A plain run times every point; `--resume` keeps the rows of the output JSON made with the same
config on the same device (each row carries the provenance of the run that timed it) and times
the rest.

    python -m experiments.kernel_bench --config configs/kernel_bench.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from experiments import common
from experiments.common import REPO_ROOT, point_provenance, provenance, write_json
from pallas_kernels.contiguous_attention import contiguous_attention, contiguous_attention_xla
from pallas_kernels.paged_attention import paged_attention, paged_attention_xla

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShapeProfile:
    """Model shapes and timing effort for one kind of device."""

    num_q_heads: int = 40  # query heads (OPT-13B: 40)
    num_kv_heads: int = 40  # KV heads; num_q_heads / num_kv_heads is the GQA group
    head_dim: int = 128  # OPT-13B: 5120 / 40
    dtype: Literal["float32", "bfloat16", "float16"] = "float16"  # cache and query dtype
    repeats: int = 20  # back-to-back calls per timing trial (the trial's mean is one sample)
    trials: int = 5  # timing trials per point; the minimum is reported

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim", "repeats", "trials"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")


@dataclasses.dataclass(frozen=True)
class PallasKnobs:
    """Tuning knobs of the Pallas kernels; `block_k` also sets the XLA paths' chunk."""

    block_k: int = 64  # key tokens per inner step / XLA scan step (power of two >= 16)
    num_splits: int | None = None  # context splits per (sequence, KV head); None: two waves of the GPU
    num_warps: int | None = None  # None: chosen from the tile (pallas_kernels.launch)
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class KernelBenchConfig:
    """The sweep (Fig. 18a: batch 8 and 32, context 64..2048) and per-device shapes."""

    first_point: list[int] = dataclasses.field(default_factory=list)  # [batch, context, block] timed first
    batch_sizes: list[int] = dataclasses.field(default_factory=lambda: [8, 32])
    context_lens: list[int] = dataclasses.field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    block_sizes: list[int] = dataclasses.field(default_factory=lambda: [8, 16, 32, 64])
    gpu: ShapeProfile = dataclasses.field(default_factory=ShapeProfile)  # OPT-13B, fp16 as in the paper
    cpu: ShapeProfile = dataclasses.field(default_factory=lambda: ShapeProfile(
        num_q_heads=4, num_kv_heads=4, dtype="float32", repeats=2, trials=3))  # fits a 2-core CPU budget
    pallas: PallasKnobs = dataclasses.field(default_factory=PallasKnobs)
    copy_bytes: int = 1 << 30  # size of the device-to-device copy that measures peak bandwidth (GPU)
    peer: bool = True  # also time JAX's own Pallas paged_attention (GPU)
    seed: int = 0
    output: str = "results/kernel_bench.json"  # JSON result, relative to the repo root
    plot: str = "results/kernel_bench.png"  # Fig. 18a-style plot; "" skips it

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "context_lens", "block_sizes"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of positive ints, got {values}")
        if any(b & (b - 1) for b in self.block_sizes):
            raise ValueError(f"block_sizes must be powers of two, got {self.block_sizes}")
        if self.first_point and (len(self.first_point) != 3 or min(self.first_point) < 1):
            raise ValueError(f"first_point must be [] or [batch, context_len, block_size] >= 1, got {self.first_point}")

    def points(self) -> list[tuple[int, int, int]]:
        """The sweep's (batch, context_len, block_size) points, `first_point` first."""
        sweep = [(b, c, bs) for b in self.batch_sizes for c in self.context_lens for bs in self.block_sizes]
        first = [tuple(self.first_point)] if self.first_point else []
        return first + [p for p in sweep if p not in first]


def _time_us(*fns: Callable[[], jax.Array], repeats: int, trials: int) -> list[float]:
    """Per function, the minimum over trials of the mean time of `repeats` back-to-back calls (us).

    Trials of the functions alternate, so a busy machine slows all of them alike.
    """
    for fn in fns:
        jax.block_until_ready(fn())  # compile + warm up
    best = [float("inf")] * len(fns)
    for _ in range(trials):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(repeats):
                out = fn()
            jax.block_until_ready(out)
            best[i] = min(best[i], (time.perf_counter() - start) / repeats)
    return [b * 1e6 for b in best]


def measure_copy_gbps(num_bytes: int, repeats: int, trials: int) -> float:
    """Device-to-device bandwidth of an elementwise copy (read + write), in GB/s."""
    x = jnp.zeros((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # + 1 keeps XLA from aliasing the input away
    [us] = _time_us(lambda: copy(x), repeats=repeats, trials=trials)
    return 2 * x.nbytes / (us * 1e-6) / 1e9


def _peer_fn(q, k_pages, v_pages, tables, lens, scale):
    """JAX's own Pallas paged_attention at these shapes, or None where its shape rules reject them."""
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except ImportError:  # not every jax release ships it
        return None
    max_blocks, block_size = tables.shape[1], k_pages.shape[2]
    # Its defaults (16 splits, 8 pages per step), shrunk to fit: it needs max_blocks % k_splits == 0
    # and whole steps per split (powers of two here), and >= 16 keys per step for Triton's dot.
    k_splits = min(16, max_blocks)
    pages_per_block = min(8, max_blocks // k_splits)
    if max_blocks % k_splits or block_size * pages_per_block < 16:
        return None

    @jax.jit
    def peer(q, k_pages, v_pages, tables, lens):
        # It applies no softmax scale: scaling q inside the same jit fuses it, as ours is.
        return jax_paged.paged_attention(q * jnp.asarray(scale, q.dtype), k_pages, v_pages, tables, lens,
                                         k_splits=k_splits, pages_per_compute_block=pages_per_block)

    return lambda: peer(q, k_pages, v_pages, tables, lens)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, shape, dtype):
    """Random normal values made on the device (no host copy of a GB-sized pool)."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _point(config: KernelBenchConfig, on_gpu: bool, batch: int, context_len: int, block_size: int) -> dict:
    """Time one (batch, context length, block size) point; returns its result row."""
    prof = config.gpu if on_gpu else config.cpu
    dtype = jnp.dtype(prof.dtype)
    keys = jax.random.split(jax.random.key(hash((config.seed, batch, context_len, block_size)) % 2**31), 6)
    max_blocks = -(-context_len // block_size)
    num_blocks = batch * max_blocks + 1  # + the reserved block 0
    shape = (prof.num_kv_heads, num_blocks, block_size, prof.head_dim)
    k_pages, v_pages = _normal(keys[0], shape, dtype), _normal(keys[1], shape, dtype)
    tables = (jax.random.permutation(keys[2], num_blocks - 1) + 1).astype(jnp.int32).reshape(batch, max_blocks)
    lens = jnp.full((batch,), context_len, jnp.int32)
    q = _normal(keys[3], (batch, prof.num_q_heads, prof.head_dim), dtype)
    scale = prof.head_dim ** -0.5
    knobs = dataclasses.asdict(config.pallas)
    if on_gpu:
        paged = jax.jit(functools.partial(paged_attention, scale=scale, **knobs))
    else:
        paged = functools.partial(paged_attention_xla, scale=scale, block_k=config.pallas.block_k)
    cache_shape = (batch, prof.num_kv_heads, max_blocks * block_size, prof.head_dim)
    k, v = _normal(keys[4], cache_shape, dtype), _normal(keys[5], cache_shape, dtype)
    if on_gpu:
        contiguous = jax.jit(functools.partial(contiguous_attention, scale=scale, **knobs))
    else:
        contiguous = functools.partial(contiguous_attention_xla, scale=scale, block_k=config.pallas.block_k)
    fns = [lambda: paged(q, k_pages, v_pages, tables, lens), lambda: contiguous(q, k, v, lens)]
    peer = _peer_fn(q, k_pages, v_pages, tables, lens, scale) if on_gpu and config.peer else None
    paged_us, contiguous_us, *peer_us = _time_us(*fns, *([peer] if peer else []), repeats=prof.repeats,
                                                 trials=prof.trials)
    row = {"batch": batch, "context_len": context_len, "block_size": block_size, "paged_us": paged_us,
           "contiguous_us": contiguous_us}
    if on_gpu and config.peer:
        row["jax_peer_us"] = peer_us[0] if peer_us else None  # None: its shape rules reject this point
        if peer:  # the same attention, or the comparison means nothing
            diff = jnp.abs(peer().astype(jnp.float32) - fns[0]().astype(jnp.float32))
            row["jax_peer_max_abs_diff"] = float(jnp.max(diff))
    row["paged_over_contiguous"] = paged_us / contiguous_us
    # Every byte a decode step must read or write: each live K and V row, q, the output, and (paged
    # only) the block tables; context lengths for both. Split-K partials are the kernels' own
    # overhead and are not counted, so GB/s compares implementations at equal useful work.
    kv = 2 * batch * context_len * prof.num_kv_heads * prof.head_dim * dtype.itemsize
    q_and_out = 2 * batch * prof.num_q_heads * prof.head_dim * dtype.itemsize
    row["contiguous_bytes_moved"] = int(kv + q_and_out + lens.nbytes)
    row["bytes_moved"] = int(row["contiguous_bytes_moved"] + tables.nbytes)
    row["paged_gbps"] = row["bytes_moved"] / (paged_us * 1e-6) / 1e9
    row["contiguous_gbps"] = row["contiguous_bytes_moved"] / (contiguous_us * 1e-6) / 1e9
    return row


def _summary(rows: list[dict], on_gpu: bool, copy_gbps: float | None) -> dict:
    """The issue's targets at the largest point (batch 32, context 2048) and over the sweep."""
    ratios = [r["paged_over_contiguous"] for r in rows]
    summary = {"max_paged_over_contiguous": max(ratios), "median_paged_over_contiguous": float(np.median(ratios))}
    big = [r for r in rows if r["batch"] == max(x["batch"] for x in rows)
           and r["context_len"] == max(x["context_len"] for x in rows)]
    summary["largest_point_paged_over_contiguous"] = {r["block_size"]: r["paged_over_contiguous"] for r in big}
    if on_gpu:
        summary["copy_gbps"] = copy_gbps
        summary["largest_point_fraction_of_copy"] = {r["block_size"]: r["paged_gbps"] / copy_gbps for r in big}
        peers = [r["jax_peer_us"] / r["paged_us"] for r in rows if r.get("jax_peer_us")]
        summary["min_speedup_over_jax_peer"] = min(peers) if peers else None
        summary["targets"] = {"fraction_of_copy": 0.85, "paged_over_contiguous": 1.10, "speedup_over_jax_peer": 1.0}
    else:
        summary["targets"] = {"paged_over_contiguous": 1.3}
    return summary


def plot(result: dict, path: Path) -> None:
    """Latency vs context length, one panel per batch size (paper Fig. 18a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        sel = [r for r in rows if r["batch"] == batch]
        for bs in sorted({r["block_size"] for r in sel}):
            pts = sorted((r["context_len"], r["paged_us"]) for r in sel if r["block_size"] == bs)
            ax.plot(*zip(*pts), marker="o", label=f"paged, block {bs}")
        contiguous = sorted((r["context_len"], r["contiguous_us"]) for r in sel if r["block_size"] == 16)
        if contiguous:
            ax.plot(*zip(*contiguous), "k--", marker="s", label="contiguous")
        peer = sorted((r["context_len"], r["jax_peer_us"]) for r in sel if r.get("jax_peer_us") and r["block_size"] == 16)
        if peer:
            ax.plot(*zip(*peer), ":", color="gray", marker="^", label="jax paged_attention, block 16")
        ax.set(xscale="log", yscale="log", xlabel="context length", ylabel="latency (us)",
               title=f"batch {batch} ({result['backend']}, {result['device']})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reusable_rows(path: Path, run_provenance: dict, keys: set[tuple[int, int, int]]) -> list[dict]:
    """Rows of `path` a resumed run may keep: timed with the same config on the same device, wanted
    (batch, context_len, block_size in `keys`), and carrying the provenance of the run that timed them."""
    if not path.exists():
        return []
    old = json.loads(path.read_text())
    if (old.get("device") != run_provenance["device"]
            or old.get("provenance", {}).get("config") != json.loads(json.dumps(run_provenance["config"]))):
        logger.warning("%s was made with another config or device: timing every point afresh", path)
        return []
    return [r for r in old.get("rows", []) if "provenance" in r and _key(r) in keys]


def _key(row: dict) -> tuple[int, int, int]:
    return row["batch"], row["context_len"], row["block_size"]


def run(config: KernelBenchConfig, resume: bool = False) -> dict:
    """Run the sweep (under `resume`, only the points the output JSON lacks), write the JSON after
    every point (atomically) and the plot; return the result."""
    on_gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0].device_kind
    backend = "pallas-triton" if on_gpu else "xla"
    out_path = REPO_ROOT / config.output
    prov = provenance(config, seed=config.seed, device=device)
    points = config.points()  # `first_point` first (gpu_check: the target point before the sweep)
    rows = reusable_rows(out_path, prov, set(points)) if resume else []
    if resume:
        print(f"kernel_bench: reused {len(rows)} of {len(points)} rows from {out_path} (--resume)")
    done = {_key(r) for r in rows}
    prof = config.gpu if on_gpu else config.cpu
    copy_gbps = measure_copy_gbps(config.copy_bytes, prof.repeats, prof.trials) if on_gpu else None
    result = {"backend": backend, "device": device, "copy_gbps": copy_gbps, "rows": rows}
    bar = tqdm([p for p in points if p not in done], desc="kernel_bench", mininterval=1.0)
    for batch, context_len, block_size in bar:
        row = _point(config, on_gpu, batch, context_len, block_size)
        rows.append({"backend": backend, "device": device, **row, "provenance": point_provenance(prov)})
        bar.set_postfix(paged_us=f"{row['paged_us']:.0f}", ratio=f"{row['paged_over_contiguous']:.2f}")
        result["summary"] = _summary(rows, on_gpu, copy_gbps)
        result["provenance"] = prov
        write_json(out_path, result)
    rows.sort(key=lambda r: points.index(_key(r)))  # reused rows and new ones in sweep order
    result["summary"] = _summary(rows, on_gpu, copy_gbps)
    result["provenance"] = prov
    write_json(out_path, result)
    if config.plot:
        plot(result, REPO_ROOT / config.plot)
    s = result["summary"]
    print(f"backend                     {backend}\ndevice                      {device}\n"
          f"copy_gbps                   {copy_gbps}\n"
          f"max_paged_over_contiguous   {s['max_paged_over_contiguous']:.3f}\n"
          f"median_paged_over_contiguous {s['median_paged_over_contiguous']:.3f}\n"
          f"largest_point_paged_over_contiguous {s['largest_point_paged_over_contiguous']}")
    if on_gpu:
        print(f"largest_point_fraction_of_copy {s['largest_point_fraction_of_copy']}\n"
              f"min_speedup_over_jax_peer   {s['min_speedup_over_jax_peer']}")
    return result


def main() -> None:
    """The command line: `python -m experiments.kernel_bench [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], KernelBenchConfig, run, "configs/kernel_bench.yaml")
