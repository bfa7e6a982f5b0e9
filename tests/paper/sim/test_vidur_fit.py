"""The committed constants reproduce from Vidur's CSVs, and the cost model matches those measurements.

Skipped when ../shared/data/vidur_a100 is absent (the constants themselves are committed).
"""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.paper.sim import fit_vidur
from jpaged.paper.sim.cost_model import CostModel
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.measured import FIT_PATH, load

DATA = Path(__file__).resolve().parents[3] / ".." / "shared" / "data" / "vidur_a100"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} absent")


def leaves(tree, prefix=""):
    """{"a.b.c": leaf} of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for key, sub in tree.items() for k, v in leaves(sub, f"{prefix}.{key}" if prefix else key).items()}


@needs_data
def test_committed_constants_reproduce_from_the_csvs():
    committed = leaves(json.loads(FIT_PATH.read_text()))
    refit = leaves(fit_vidur.fit_all(DATA))
    assert set(refit) <= set(committed)
    for key, value in refit.items():
        assert value == (pytest.approx(committed[key], rel=1e-6) if isinstance(value, float) else committed[key]), key


@needs_data
def test_gemm_time_matches_the_measured_llama_layer():
    """The cost model's GEMM time of Llama-2-7B (TP 1) against the four measured projections."""
    mlp = fit_vidur.read_csv(DATA / "mlp_llama2_7b.csv")
    # Vidur's layer has no LM head: a one-word vocabulary makes ours one kernel of negligible work.
    spec = dataclasses.replace(get_preset("llama-7b"), vocab_size=1)
    model = CostModel(spec, get_gpu(fit_vidur.MEASURED_GPU))
    rows = mlp["num_tensor_parallel_workers"] == 1
    for tokens in (1, 8, 64, 256, 1024, 4096):
        at = rows & (mlp["num_tokens"] == tokens)
        measured = 32 * sum(np.median(mlp[f"time_stats.{op}.median"][at]) for op in fit_vidur.GEMM_OPS) * 1e-3
        q = np.ones(tokens, np.int32)
        layers = model.breakdown(q, q)["gemm"] - model.config.gemm_kernel_s
        assert layers == pytest.approx(measured, rel=0.2), tokens


@needs_data
def test_host_overhead_matches_the_measured_steps():
    cpu = fit_vidur.read_csv(DATA / "cpu_overheads.csv")
    measured = fit_vidur.host_overhead_ms(cpu) * 1e-3
    constants = load()
    for i in np.flatnonzero(np.isin(cpu["model_name"], fit_vidur.HOST_MODELS)):
        line = constants.host_overhead(int(cpu["tensor_parallel_degree"][i]))
        assert line.seconds(int(cpu["batch_size"][i])) == pytest.approx(measured[i], rel=0.15)
    # The numbers: about 3.0 / 7.8 / 12.6 ms at batch 8 / 32 / 64 on one GPU.
    assert [round(constants.host_overhead(1).seconds(b) * 1e3, 1) for b in (8, 32, 64)] == pytest.approx(
        [3.0, 7.8, 12.6], abs=0.5)


@needs_data
def test_all_reduce_matches_the_measured_nvlink_pair():
    ar = fit_vidur.read_csv(DATA / "all_reduce_pairwise_nvlink.csv")
    rows = (ar["num_workers"] == 2) & (ar["size"] >= 4e6)  # above the bimodal small-message region
    constants = load()
    x = [constants.allreduce_floor_s, constants.allreduce_fixed_s, constants.nvlink_efficiency * 300e9]
    predicted = fit_vidur.all_reduce_time(x, ar["size"][rows])  # 2 GPUs: ring bytes = message bytes
    assert np.median(np.abs(predicted / (ar["time_stats.all_reduce.median"][rows] * 1e-3) - 1)) < 0.05


def test_load_names_the_file_and_key(tmp_path):
    broken = tmp_path / "fit.json"
    data = json.loads(FIT_PATH.read_text())
    del data["gemm"]["roofline_exponent"]
    broken.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="fit.json: missing key 'roofline_exponent'"):
        load(broken)


def test_missing_data_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="cpu_overheads.csv"):
        fit_vidur.fit_all(tmp_path)
