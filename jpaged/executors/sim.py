"""SimExecutor: runs a StepPlan on a virtual clock, timing it with the roofline cost model.

The scheduler and block manager run for real; only the model's step time is modeled. No logits
are produced: under simulation output lengths come from the workload (EOS is ignored).
"""

from __future__ import annotations

import numpy as np

from jpaged.executors.base import StepResult
from jpaged.models.presets import ModelSpec
from jpaged.sim.cost_model import CostModel, CostModelConfig
from jpaged.sim.gpus import GpuSpec, get_gpu
from jpaged.sim.profiled import FittedCostModel
from jpaged.step_plan import StepPlan


class SimExecutor:
    """Executor whose clock is virtual: each `execute` advances it by the step's modeled time.

    Steps return no logits: the engine appends placeholder tokens (lengths come from max_tokens).
    """

    def __init__(self, spec: ModelSpec, cost: CostModelConfig = CostModelConfig(),
                 gpu: GpuSpec | str = "a100-40gb", tp: int = 1, dtype: str = "float16",
                 block_size: int = 16, *, fitted: FittedCostModel | None = None) -> None:
        """Times steps with a roofline `CostModel` of (spec, cost, gpu, tp, dtype, block_size), or, in
        profiled mode, with `fitted`, which then replaces it (the fit carries its own swap/copy model)."""
        gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.cost_model = fitted or CostModel(spec, gpu, cost, tp=tp, dtype=dtype, block_size=block_size)
        self.vocab_size = spec.vocab_size  # the engine checks prompt token ids against it
        self._clock = 0.0  # virtual seconds since the start of the run
        self.busy_s = 0.0  # virtual seconds spent executing steps (the rest is idle waiting)
        self.num_steps = 0  # steps executed, including block-op-only steps

    def execute(self, plan: StepPlan) -> StepResult:
        """Advances the clock by the plan's swap, copy and model time; returns that duration."""
        cost = self.cost_model
        duration = (cost.swap_time(len(plan.swap_out_pairs)) + cost.swap_time(len(plan.swap_in_pairs))
                    + cost.copy_time(len(plan.copy_pairs)))
        n = plan.num_seqs
        if n:
            context_lens = plan.context_lens[:n]
            if plan.is_prefill:
                duration += cost.prefill_time(np.diff(plan.query_start_loc[:n + 1]), context_lens)
            else:
                duration += cost.decode_time(context_lens)
        self._clock += duration
        self.busy_s += duration
        self.num_steps += 1
        return StepResult(logits=None, duration=duration)

    def now(self) -> float:
        """The virtual clock in seconds."""
        return self._clock

    def advance_to(self, t: float) -> None:
        """Moves the clock forward to `t` (an idle engine waiting for the next arrival); never back."""
        if t > self._clock:
            self._clock = t
