"""Fit the cost model's constants on Vidur's measurements of vLLM on A100 GPUs (run offline).

    python -m jpaged.paper.sim.fit_vidur --data ../shared/data/vidur_a100

writes jpaged/paper/sim/vidur_a100_fit.json, which the cost model reads; nothing reads the CSVs at run
time. The data (Microsoft's Vidur project, MIT licence; what each file is: its README) are
measurements of real runs, never the paper's figures. Each constant is fitted in the regime it
governs, by least squares on relative error:

- GEMMs (mlp_llama2_7b.csv, the four projections of one Llama-2-7B layer, median kernel times):
  achieved HBM bandwidth from the memory-bound points (<= 16 tokens), achieved tensor-core FLOP/s
  from the compute-bound points (>= 1024 tokens), then the per-kernel fixed time and the sharpness
  of the memory-to-compute transition on all points. TP 1 only: its matrices (34-180 MB) have the
  size the simulated models' per-GPU matrices have (38-210 MB); TP 2-8 are a held-out check.
- Elementwise ops (norms, RoPE, activation, residual add, same file): a per-layer floor (launch-bound
  at small batches) and an achieved bandwidth over the activation bytes `shapes` counts.
- Host overhead (cpu_overheads.csv): a line in the batch size per TP degree through vLLM's CPU work
  per step (schedule + sampler + prepare inputs + process outputs, means: a simulated run's total
  time is steps x the mean) plus, with TP > 1, the Ray driver-worker time (only its median exists).
  Llama-2 7B / 70B only: CodeLlama-34B's 16K context window triples input preparation per sequence
  (block tables padded to the window); OPT's window is 2K.
- All-reduce (all_reduce_pairwise_nvlink.csv, medians): t = max(floor, fixed + ring bytes / bus
  bandwidth) on the 2-GPU NVLink pair. The 4-GPU rows cross PCIe on that machine (12x slower), so
  they describe no NVSwitch server; they are kept as a check of the functional form.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from jpaged.config.presets import get_preset
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.shapes import elementwise_elements_per_token, gemm_params_per_layer

DEFAULT_OUT = Path(__file__).resolve().with_name("vidur_a100_fit.json")
_REPO_ROOT = Path(__file__).resolve().parents[2]
FILES = ("cpu_overheads.csv", "mlp_llama2_7b.csv", "all_reduce_pairwise_nvlink.csv")
# The profiled GPU: Vidur's "a100" device is an 80 GB A100, and pairwise NVLink bridges exist only
# on PCIe boards (SXM boards connect through NVSwitch), hence the PCIe A100-80GB's datasheet.
MEASURED_GPU = "a100-80gb-pcie"
HOST_MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf")
HOST_PARTS = ("SCHEDULE", "SAMPLER_E2E", "PREPARE_INPUTS_E2E", "PROCESS_MODEL_OUTPUTS")
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")  # shapes.gemm_params_per_layer order
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")


def read_csv(path: Path) -> dict[str, np.ndarray]:
    """Columns of a CSV file: float arrays where every value parses, string arrays otherwise."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no data rows")
    columns = {}
    for name in rows[0]:
        values = [r[name] for r in rows]
        try:
            columns[name] = np.array(values, dtype=np.float64)
        except ValueError:
            columns[name] = np.array(values)
    return columns


def _relative_fit(model, x0, measured, **kwargs) -> np.ndarray:
    """Parameters minimising the squared relative error of model(params) against `measured`."""
    return least_squares(lambda x: model(x) / measured - 1.0, x0, **kwargs).x


def _error_summary(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    rel = predicted / measured - 1.0
    return {"median_abs_rel_err": float(np.median(np.abs(rel))), "p90_abs_rel_err": float(np.percentile(np.abs(rel), 90)),
            "mean_rel_err": float(rel.mean()), "points": int(len(rel))}


def gemm_time(x: np.ndarray, weight_bytes: np.ndarray, flops: np.ndarray, hbm_bw: float, peak_flops: float) -> np.ndarray:
    """Seconds of GEMM kernels: kernel_s + (mem^p + compute^p)^(1/p), x = (hbm eff, tc eff, kernel_s, p)."""
    hbm_eff, tc_eff, kernel_s, p = x
    mem, compute = weight_bytes / (hbm_bw * hbm_eff), flops / (peak_flops * tc_eff)
    return kernel_s + (mem**p + compute**p) ** (1.0 / p)


def fit_gemm(mlp: dict[str, np.ndarray]) -> dict:
    """Achieved HBM and tensor-core efficiency, per-kernel time and transition exponent (see module doc)."""
    gpu, spec = get_gpu(MEASURED_GPU), get_preset("llama-7b")
    tokens_all, tp_all = mlp["num_tokens"], mlp["num_tensor_parallel_workers"].astype(int)
    tokens, weights, seconds, tps = [], [], [], []
    for tp in np.unique(tp_all):
        rows = tp_all == tp
        for op, params in zip(GEMM_OPS, gemm_params_per_layer(spec, int(tp))):
            tokens.append(tokens_all[rows])
            weights.append(np.full(rows.sum(), 2.0 * params))  # fp16 bytes
            seconds.append(mlp[f"time_stats.{op}.median"][rows] * 1e-3)
            tps.append(np.full(rows.sum(), tp))
    n, w, t, tps = (np.concatenate(a) for a in (tokens, weights, seconds, tps))
    flops = n * w  # 2 FLOP per weight per token, and 2 bytes per weight
    bw, peak = gpu.hbm_bw, gpu.fp16_flops
    fit_set = tps == 1
    small, large = fit_set & (n <= 16), fit_set & (n >= 1024)
    hbm_eff, _ = _relative_fit(lambda x: w[small] / (bw * x[0]) + x[1] * 1e-6, [0.8, 5.0], t[small])
    tc_eff, _ = _relative_fit(lambda x: flops[large] / (peak * x[0]) + x[1] * 1e-6, [0.7, 5.0], t[large])
    kernel_us, p = _relative_fit(
        lambda x: gemm_time([hbm_eff, tc_eff, x[0] * 1e-6, x[1]], w[fit_set], flops[fit_set], bw, peak),
        [5.0, 2.0], t[fit_set], bounds=([0.0, 1.0], [100.0, 50.0]))
    x = np.array([hbm_eff, tc_eff, kernel_us * 1e-6, p])
    predicted = gemm_time(x, w, flops, bw, peak)
    return {"hbm_efficiency": float(hbm_eff), "tensor_core_efficiency": float(tc_eff),
            "gemm_kernel_s": float(kernel_us * 1e-6), "roofline_exponent": float(p),
            "achieved_hbm_bw": float(hbm_eff * bw), "achieved_tensor_flops": float(tc_eff * peak),
            "fit": _error_summary(predicted[fit_set], t[fit_set]),
            "check_tp_2_4_8": _error_summary(predicted[~fit_set], t[~fit_set])}


def elementwise_time(x: np.ndarray, elements: np.ndarray, hbm_bw: float) -> np.ndarray:
    """Seconds of one layer's elementwise kernels: max(floor_s, fp16 bytes / (bw x eff)), x = (eff, floor_s)."""
    return np.maximum(x[1], 2.0 * elements / (hbm_bw * x[0]))


def fit_elementwise(mlp: dict[str, np.ndarray]) -> dict:
    """Per-layer floor and achieved bandwidth of the norms, RoPE, activation and residual add."""
    gpu, spec = get_gpu(MEASURED_GPU), get_preset("llama-7b")
    tp = mlp["num_tensor_parallel_workers"].astype(int)
    per_token = np.array([elementwise_elements_per_token(spec, int(d)) for d in tp])
    elements = mlp["num_tokens"] * per_token
    seconds = sum(mlp[f"time_stats.{op}.median"] for op in ELEMENTWISE_OPS) * 1e-3
    eff, floor_us = _relative_fit(lambda x: elementwise_time([x[0], x[1] * 1e-6], elements, gpu.hbm_bw),
                                  [0.5, 20.0], seconds)
    predicted = elementwise_time([eff, floor_us * 1e-6], elements, gpu.hbm_bw)
    return {"elementwise_efficiency": float(eff), "elementwise_floor_s": float(floor_us * 1e-6),
            "fit": _error_summary(predicted, seconds)}


def host_overhead_ms(cpu: dict[str, np.ndarray]) -> np.ndarray:
    """vLLM's measured CPU time per step, ms: the four parts' means, plus Ray's median with TP > 1."""
    total = sum(cpu[f"{part}_MEAN"] for part in HOST_PARTS)
    return total + np.where(cpu["tensor_parallel_degree"] > 1, cpu["RAY_COMM_TIME_MEDIAN"], 0.0)


def fit_host_overhead(cpu: dict[str, np.ndarray]) -> dict:
    """Host seconds per step = fixed + per_seq x batch, one line per measured TP degree."""
    total_s = host_overhead_ms(cpu) * 1e-3
    batch, tp, model = cpu["batch_size"], cpu["tensor_parallel_degree"].astype(int), cpu["model_name"]
    lines = {}
    for degree in np.unique(tp):
        rows = (tp == degree) & np.isin(model, HOST_MODELS)
        per_seq, fixed = np.polyfit(batch[rows], total_s[rows], 1)
        lines[str(degree)] = {"fixed_s": float(fixed), "per_seq_s": float(per_seq),
                              "models": sorted(set(model[rows].tolist())),
                              "batch_sizes": sorted(set(batch[rows].astype(int).tolist())),
                              "fit": _error_summary(fixed + per_seq * batch[rows], total_s[rows])}
    return lines


def all_reduce_time(x: np.ndarray, ring_bytes: np.ndarray) -> np.ndarray:
    """Seconds of one all-reduce: max(floor_s, fixed_s + ring bytes / bus_bw), x = (floor_s, fixed_s, bus_bw)."""
    return np.maximum(x[0], x[1] + ring_bytes / x[2])


def fit_all_reduce(ar: dict[str, np.ndarray]) -> dict:
    """Latency floor, fixed time and bus bandwidth of NCCL all-reduce (see module doc)."""
    result = {}
    for workers in (2, 4):
        rows = ar["num_workers"] == workers
        ring = 2.0 * (workers - 1) / workers * ar["size"][rows]  # bytes each GPU sends in a ring all-reduce
        seconds = ar["time_stats.all_reduce.median"][rows] * 1e-3
        # soft_l1: the small messages are bimodal (10-15 us or ~60 us); the fit follows the majority.
        floor_us, fixed_us, bus_gbs = _relative_fit(
            lambda x: all_reduce_time([x[0] * 1e-6, x[1] * 1e-6, x[2] * 1e9], ring), [60.0, 30.0, 150.0], seconds,
            loss="soft_l1", f_scale=0.05)
        predicted = all_reduce_time([floor_us * 1e-6, fixed_us * 1e-6, bus_gbs * 1e9], ring)
        result[str(workers)] = {"floor_s": float(floor_us * 1e-6), "fixed_s": float(fixed_us * 1e-6),
                                "bus_bw": float(bus_gbs * 1e9), "fit": _error_summary(predicted, seconds)}
    result["nvlink_efficiency"] = result["2"]["bus_bw"] / get_gpu(MEASURED_GPU).nvlink_bw
    return result


def fit_all(data_dir: Path) -> dict:
    """Every fit, plus the SHA-256 of each input file."""
    data_dir = Path(data_dir)
    missing = [f for f in FILES if not (data_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"--data {data_dir}: missing {', '.join(missing)}")
    mlp = read_csv(data_dir / "mlp_llama2_7b.csv")
    return {"gemm": fit_gemm(mlp), "elementwise": fit_elementwise(mlp),
            "host_overhead": fit_host_overhead(read_csv(data_dir / "cpu_overheads.csv")),
            "all_reduce": fit_all_reduce(read_csv(data_dir / "all_reduce_pairwise_nvlink.csv")),
            "inputs": {f: hashlib.sha256((data_dir / f).read_bytes()).hexdigest() for f in FILES}}


def _git_sha() -> str:
    """HEAD's commit, '+dirty' when tracked files differ from it (the output file aside)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=_REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    f":(exclude){DEFAULT_OUT.relative_to(_REPO_ROOT)}")
        return git("rev-parse", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    """CLI: fit on --data, write the constants with provenance to --out."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="folder holding Vidur's A100 CSVs (../shared/data/vidur_a100)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"output JSON (default {DEFAULT_OUT})")
    args = parser.parse_args()
    fitted = fit_all(Path(args.data))
    out = {"source": {"data": "Vidur (github.com/microsoft/vidur, MIT licence): measurements of vLLM on A100 GPUs, "
                              "data/profiling/ (README beside the CSVs names each file's origin and commit)",
                      "measured_gpu": MEASURED_GPU},
           "provenance": {"script": "python -m jpaged.paper.sim.fit_vidur", "git_sha": _git_sha(),
                          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
           **fitted}
    out_path = Path(args.out)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=out_path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_path)
    print(json.dumps({k: out[k] for k in ("gemm", "elementwise", "all_reduce")}, indent=2))


if __name__ == "__main__":
    main()
