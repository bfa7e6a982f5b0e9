"""The cost model's measured constants: the committed fit on Vidur's A100 data (vidur_a100_fit.json).

`python -m jpaged.paper.sim.fit_vidur --data ../shared/data/vidur_a100` regenerates the file; nothing
here reads the measurements themselves, so the simulator needs no data folder at run time.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FIT_PATH = Path(__file__).with_name("vidur_a100_fit.json")


@dataclasses.dataclass(frozen=True)
class HostOverhead:
    """vLLM's CPU time per engine step at one TP degree: fixed_s + per_seq_s x batch size."""

    tp: int  # the measured tensor-parallel degree this line was fitted at
    fixed_s: float  # seconds per step at batch 0 (intercept)
    per_seq_s: float  # seconds per sequence in the batch

    def seconds(self, num_seqs: int) -> float:
        """Host seconds of a step running `num_seqs` sequences."""
        return self.fixed_s + self.per_seq_s * num_seqs


@dataclasses.dataclass(frozen=True)
class MeasuredConstants:
    """Every constant `fit_vidur` fitted; the fields' meanings are in CostModelConfig."""

    hbm_efficiency: float
    tensor_core_efficiency: float
    gemm_kernel_s: float
    roofline_exponent: float
    elementwise_efficiency: float
    elementwise_floor_s: float
    allreduce_floor_s: float
    allreduce_fixed_s: float
    nvlink_efficiency: float
    host: tuple[HostOverhead, ...]  # ascending tp

    def host_overhead(self, tp: int) -> HostOverhead:
        """The line of the largest measured TP degree <= `tp` (TP 8 was not measured: TP 4's line)."""
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        return [line for line in self.host if line.tp <= tp][-1]


def load(path: str | Path = FIT_PATH) -> MeasuredConstants:
    """Reads a fit written by `fit_vidur`; ValueError naming the file and key when one is missing."""
    path = Path(path)
    data = json.loads(path.read_text())
    try:
        gemm, elem, ar = data["gemm"], data["elementwise"], data["all_reduce"]
        host = tuple(HostOverhead(int(tp), line["fixed_s"], line["per_seq_s"])
                     for tp, line in sorted(data["host_overhead"].items(), key=lambda kv: int(kv[0])))
        return MeasuredConstants(
            hbm_efficiency=gemm["hbm_efficiency"], tensor_core_efficiency=gemm["tensor_core_efficiency"],
            gemm_kernel_s=gemm["gemm_kernel_s"], roofline_exponent=gemm["roofline_exponent"],
            elementwise_efficiency=elem["elementwise_efficiency"], elementwise_floor_s=elem["elementwise_floor_s"],
            allreduce_floor_s=ar["2"]["floor_s"], allreduce_fixed_s=ar["2"]["fixed_s"],
            nvlink_efficiency=ar["nvlink_efficiency"], host=host)
    except KeyError as exc:
        raise ValueError(f"{path}: missing key {exc}; regenerate it with python -m jpaged.paper.sim.fit_vidur") from None


VIDUR_A100 = load()
