"""SimConfig: the modeled hardware of the simulated executor, beside its cost model's constants.

The engine's own configuration (`jpaged.config`) sits below every wing; this one holds the cost
model's efficiencies (`CostModelConfig`), whose defaults are the committed fit on measured data
(`jpaged.paper.sim.measured`), so it lives with the simulator. Experiments nest it under `sim:`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from jpaged.paper.sim.cost_model import CostModelConfig


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The modeled hardware of the simulated executor (ignored by the real one)."""

    gpu: str = "a100-40gb"  # jpaged.paper.sim.gpus name: a100-40gb, a100-80gb, h100, h200
    tp: int = 1  # tensor-parallel GPUs (Megatron); the KV pool is the per-GPU pool's block ids
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"  # modeled weight and KV dtype (paper: FP16)
    cost: CostModelConfig = dataclasses.field(default_factory=CostModelConfig)  # efficiencies, overheads
    # FasterTransformer's host seconds per step: none (a C++ loop that runs ahead of the GPU) or
    # vllm (the measured Python line every other system pays; a sensitivity setting)
    fastertransformer_host_overhead: Literal["none", "vllm"] = "none"
    # Beam candidates: null = seeded random (synthetic_candidates); a path (.npz, relative to the
    # working directory) = a trained model's recorded beam search, replayed (jpaged.paper.sim.executor.BeamReplay)
    beam_trace: str | None = None

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"sim.tp must be >= 1, got {self.tp}")
        if self.fastertransformer_host_overhead not in ("none", "vllm"):
            raise ValueError(f"sim.fastertransformer_host_overhead must be 'none' or 'vllm', "
                             f"got {self.fastertransformer_host_overhead!r}")
