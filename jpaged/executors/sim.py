"""SimExecutor: runs a StepPlan on a virtual clock, timing it with the roofline cost model.

The scheduler and block manager run for real; only the model's step time is modeled. There is
no model, so sampled tokens are synthetic: every row gets SIMULATED_TOKEN (output lengths come
from the workload, EOS is ignored), and beam rows get seeded random candidates, so that beams
still branch, share and die as in a real search and memory sharing can be measured.
"""

from __future__ import annotations

import numpy as np

from jpaged.executors.base import ModelOutput
from jpaged.models.presets import ModelSpec
from jpaged.sequence import request_stream
from jpaged.sim.cost_model import CostModel, CostModelConfig
from jpaged.sim.gpus import GpuSpec, get_gpu
from jpaged.sim.profiled import FittedCostModel
from jpaged.step_plan import SampleRows, StepPlan

# The token every simulated sample is (lengths come from max_tokens).
SIMULATED_TOKEN = 0


class SimExecutor:
    """Executor whose clock is virtual: each `execute` advances it by the step's modeled time."""

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

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Advances the clock by the plan's swap, copy and model time; samples synthetic tokens."""
        rows = plan.sampling
        # Synthetic samples before the clock moves: a failure leaves the executor as it was.
        top_ids, top_logprobs = synthetic_candidates(rows) if rows is not None and rows.num_top else (None, None)
        cost = self.cost_model
        duration = (cost.swap_time(len(plan.swap_out_pairs)) + cost.swap_time(len(plan.swap_in_pairs))
                    + cost.copy_time(len(plan.copy_pairs)))
        if plan.num_seqs:  # any mix of prompt chunks and decodes, priced in one step
            duration += cost.step_time(plan.query_lens, plan.context_lens[: plan.num_seqs])
        self._clock += duration
        self.busy_s += duration
        self.num_steps += 1
        if rows is None:
            return ModelOutput([], None, None, None, duration)
        return ModelOutput([SIMULATED_TOKEN] * len(rows), None, top_ids, top_logprobs, duration)

    def now(self) -> float:
        """The virtual clock in seconds."""
        return self._clock

    def advance_to(self, t: float) -> None:
        """Moves the clock forward to `t` (an idle engine waiting for the next arrival); never back."""
        if t > self._clock:
            self._clock = t


def synthetic_candidates(rows: SampleRows) -> tuple[np.ndarray, np.ndarray]:
    """Beam candidates without a model: seeded random log-probabilities, i32/f32[R, num_top].

    The draws depend only on (seed, request, position, beam's rank among its group's rows), like
    real sampling; rows that are not beams are left at -inf.
    """
    top_ids = np.zeros((len(rows), rows.num_top), np.int32)
    top_logprobs = np.full((len(rows), rows.num_top), -np.inf)
    seen: dict[int, int] = {}  # id(group) -> its beams so far in this step
    for r, seq in enumerate(rows.seqs):
        group = seq.group
        params = group.sampling_params
        if not params.use_beam_search:
            continue
        beam = seen.get(id(group), 0)
        seen[id(group)] = beam + 1
        k = 2 * params.n
        # Keyed by the request id even under an explicit seed: no model, so requests that share a
        # seed would otherwise draw identical candidates whatever their prompts.
        rng = np.random.default_rng((group.seed, request_stream(group.request_id), len(seq), beam))
        top_logprobs[r, :k] = -np.cumsum(rng.exponential(1.0, k))  # descending
        top_ids[r, :k] = np.arange(SIMULATED_TOKEN, SIMULATED_TOKEN + k)
    return top_ids, top_logprobs
