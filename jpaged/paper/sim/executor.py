"""SimExecutor: runs a StepPlan on a virtual clock, timing it with the roofline cost model.

The scheduler and block manager run for real; only the model's step time is modeled. There is
no model, so sampled tokens are synthetic: every row gets SIMULATED_TOKEN (output lengths come
from the workload, EOS is ignored). Beam rows need candidates, so that beams still branch, share
and die as in a real search and memory sharing can be measured; two branching models give them:
- `synthetic_candidates` (the default): seeded random log-probabilities of one flat shape;
- `BeamReplay`: the candidates a trained model proposed in a recorded beam search
  (experiments/record_beams/__init__.py), replayed step by step, so beams branch as that model's did.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable

import numpy as np

from jpaged.config.presets import ModelSpec
from jpaged.core.sequence import request_stream
from jpaged.core.step_plan import ModelOutput, SampleRows, StepPlan
from jpaged.executors.base import PendingStep
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.gpus import GpuSpec, get_gpu
from jpaged.paper.sim.profiled import FittedCostModel

# The token every simulated sample is (lengths come from max_tokens).
SIMULATED_TOKEN = 0

# Beam candidates of a step's rows: (top_ids i32[R, K], top_logprobs f32[R, K]), -inf where unused.
CandidateSource = Callable[[SampleRows], tuple[np.ndarray, np.ndarray]]


class SimExecutor:
    """Executor whose clock is virtual: each `execute` advances it by the step's modeled time (or,
    `timed`, whose steps take their modeled time in wall time)."""

    num_compilations = 0  # nothing compiles: steps are priced, not run

    def __init__(self, spec: ModelSpec, cost: CostModelConfig = CostModelConfig(),
                 gpu: GpuSpec | str = "a100-40gb", tp: int = 1, dtype: str = "float16",
                 block_size: int = 16, *, fitted: FittedCostModel | None = None,
                 candidates: CandidateSource | None = None, timed: bool = False) -> None:
        """Times steps with a roofline `CostModel` of (spec, cost, gpu, tp, dtype, block_size), or, in
        profiled mode, with `fitted`, which then replaces it (the fit carries its own swap/copy model).
        `candidates` gives beam rows their candidates (default `synthetic_candidates`). `timed`: the
        clock is wall time and a step's modeled time is really waited for, from its launch to its
        collection, as a device would take it, so the host's work can overlap it (the overlapped
        engine loop's measurement); otherwise the clock is virtual and nothing waits."""
        gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.cost_model = fitted or CostModel(spec, gpu, cost, tp=tp, dtype=dtype, block_size=block_size)
        self.vocab_size = spec.vocab_size  # the engine checks prompt token ids against it
        self.candidates = candidates or synthetic_candidates
        self.timed = timed
        self._clock = 0.0  # virtual seconds since the start of the run (timed: unused)
        self._start = time.perf_counter()  # timed: the clock's zero
        self._device_free_at = 0.0  # timed: when the last launched step ends (steps run one after another)
        self.busy_s = 0.0  # modeled seconds spent executing steps (the rest is idle waiting)
        self.num_steps = 0  # steps executed, including block-op-only steps

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Advances the clock by the plan's swap, copy and model time; samples synthetic tokens.

        Swap-outs, swap-ins (swapped groups and promoted prefix-cache blocks) and copies come
        before the model step, which waits for them. The host tier's offloads (evicted cached
        blocks copied out) run beside the step on the device-to-host direction of the link, as a
        copy stream ahead of the blocks' reuse does (vLLM's KV offloading, SGLang HiCache's
        write-back): the step takes the longer of the two."""
        rows = plan.sampling
        # Synthetic samples before the clock moves: a failure leaves the executor as it was.
        top_ids, top_logprobs = self.candidates(rows) if rows is not None and rows.num_top else (None, None)
        pending = self.launch(plan)
        self._wait(pending)
        return _output(rows, pending.handle[0], top_ids, top_logprobs)

    def launch(self, plan: StepPlan) -> PendingStep:
        """Prices the step and starts it: the virtual clock moves by its time, or (timed) the step
        ends that long after the device is free; returns at once."""
        started = self.now()
        duration = self.step_time(plan)
        self.busy_s += duration
        self.num_steps += 1
        if not self.timed:
            self._clock += duration
            return PendingStep(plan, started, (duration, None))
        self._device_free_at = max(self._device_free_at, started) + duration
        return PendingStep(plan, started, (duration, self._device_free_at))

    def collect(self, pending: PendingStep) -> ModelOutput:
        """The step's synthetic tokens for the rows its plan holds now; timed: waits until it ends."""
        rows = pending.plan.sampling
        top_ids, top_logprobs = self.candidates(rows) if rows is not None and rows.num_top else (None, None)
        self._wait(pending)
        return _output(rows, pending.handle[0], top_ids, top_logprobs)

    def _wait(self, pending: PendingStep) -> None:
        """Timed: sleeps until the launched step ends."""
        ready_at = pending.handle[1]
        if ready_at is not None:
            wait = ready_at - self.now()
            if wait > 0:
                time.sleep(wait)

    def step_time(self, plan: StepPlan) -> float:
        """The plan's modeled seconds: swaps, copies, its batch priced in one step, and the host
        tier's offloads beside it."""
        cost = self.cost_model
        duration = (cost.swap_time(len(plan.swap_out_pairs)) + cost.swap_time(len(plan.swap_in_pairs))
                    + cost.copy_time(len(plan.copy_pairs)))
        model = cost.step_time(plan.query_lens, plan.context_lens[: plan.num_seqs]) if plan.num_seqs else 0.0
        # the host tier's offloads run beside the step (execute's docstring): the longer of the two
        duration += max(model, cost.swap_time(len(plan.offload_pairs))) if len(plan.offload_pairs) else model
        return duration

    def now(self) -> float:
        """The clock in seconds: virtual, or (timed) wall time since the executor was built."""
        return time.perf_counter() - self._start if self.timed else self._clock

    def advance_to(self, t: float) -> None:
        """Moves the clock forward to `t` (an idle engine waiting for the next arrival); never back.
        Timed: sleeps until then."""
        if self.timed:
            time.sleep(max(0.0, t - self.now()))
        elif t > self._clock:
            self._clock = t


def _output(rows: SampleRows | None, duration: float, top_ids, top_logprobs) -> ModelOutput:
    """A simulated step's answer: SIMULATED_TOKEN for every row, beam rows' candidates."""
    if rows is None:
        return ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=duration)
    return ModelOutput(token_ids=[SIMULATED_TOKEN] * len(rows), logprobs=None, top_ids=top_ids,
                       top_logprobs=top_logprobs, duration=duration)


def synthetic_candidates(rows: SampleRows) -> tuple[np.ndarray, np.ndarray]:
    """Beam candidates without a model: seeded random log-probabilities, i32/f32[R, num_top].

    The draws depend only on (seed, request, position, beam's rank among its group's rows), like
    real sampling; rows that are not beams are left at -inf. Every beam's candidates have the same
    shape (gaps between consecutive log-probabilities ~ Exponential(1)) at every position.
    """
    top_ids = np.zeros((len(rows), rows.num_top), np.int32)
    top_logprobs = np.full((len(rows), rows.num_top), -np.inf)
    for r, seq, rank, n in beam_rows(rows):
        group = seq.group
        k = 2 * n
        # Keyed by the request id even under an explicit seed: no model, so requests that share a
        # seed would otherwise draw identical candidates whatever their prompts.
        rng = np.random.default_rng((group.seed, request_stream(group.request_id), len(seq), rank))
        top_logprobs[r, :k] = -np.cumsum(rng.exponential(1.0, k))  # descending
        top_ids[r, :k] = np.arange(SIMULATED_TOKEN, SIMULATED_TOKEN + k)
    return top_ids, top_logprobs


def beam_rows(rows: SampleRows):
    """(row, sequence, beam rank, width) of every beam row: rank = its order among its group's rows."""
    seen: dict[int, int] = {}  # id(group) -> its beams so far in this step
    for r, seq in enumerate(rows.seqs):
        params = seq.group.sampling_params
        if params.use_beam_search:
            rank = seen.get(id(seq.group), 0)
            seen[id(seq.group)] = rank + 1
            yield r, seq, rank, params.n


class BeamReplay:
    """Beam candidates recorded from a trained model's beam search, replayed by the simulator.

    The file (numpy .npz, written by experiments/record_beams/__init__.py) holds, for each recorded width n,
    `ids_<n>` i32[K, L, n, 2n] and `logprobs_<n>` f32[K, L, n, 2n]: trace k's candidates at output
    step t for the beam of rank b (its order among its group's rows in that step; step 0 has one
    row, the prompt's, so rows 1.. of step 0 are unused). A simulated request of width n replays
    trace `request_stream(request_id) % K` (explicit seeds set no trace: requests sharing one still
    replay different searches): at every step its rank-b beam gets the recorded rank-b candidates.
    The engine's beam step is deterministic, so the simulated search follows the recorded one
    exactly: the same parents fork, the same beams die. A request longer than the recording (L
    steps) keeps replaying the trace's second half in a loop (step t >= L reads step
    h + (t - h) mod (L - h), h = L // 2): branching past the recording is assumed stationary.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"beam trace file {self.path} does not exist "
                                    "(python -m experiments.record_beams writes it)")
        with np.load(self.path) as data:
            widths = sorted(int(k.split("_")[1]) for k in data.files if k.startswith("logprobs_"))
            self.ids = {n: data[f"ids_{n}"].astype(np.int32) for n in widths}  # n -> i32[K, L, n, 2n]
            self.logprobs = {n: data[f"logprobs_{n}"].astype(np.float32) for n in widths}  # n -> f32[K, L, n, 2n]
        for n in widths:
            if self.logprobs[n].ndim != 4 or self.logprobs[n].shape[2:] != (n, 2 * n):
                raise ValueError(f"{self.path}: logprobs_{n} must be [K, L, {n}, {2 * n}], got {self.logprobs[n].shape}")
        if not widths:
            raise ValueError(f"{self.path}: no logprobs_<width> arrays")

    @property
    def widths(self) -> list[int]:
        """The beam widths the file recorded."""
        return sorted(self.logprobs)

    def step_of(self, t: int, length: int) -> int:
        """The recorded step that output step `t` replays (see the class docstring)."""
        if t < length:
            return t
        half = length // 2
        return half + (t - half) % (length - half)

    def __call__(self, rows: SampleRows) -> tuple[np.ndarray, np.ndarray]:
        """The recorded candidates of the step's beam rows, i32/f32[R, num_top]; others -inf."""
        top_ids = np.zeros((len(rows), rows.num_top), np.int32)
        top_logprobs = np.full((len(rows), rows.num_top), -np.inf, np.float32)
        for r, seq, rank, n in beam_rows(rows):
            logprobs = self.logprobs.get(n)
            if logprobs is None:
                raise ValueError(f"{self.path} recorded beam widths {self.widths}, not {n}")
            k = request_stream(seq.group.request_id) % logprobs.shape[0]
            t = self.step_of(seq.num_output_tokens, logprobs.shape[1])
            top_ids[r, : 2 * n] = self.ids[n][k, t, rank]
            top_logprobs[r, : 2 * n] = logprobs[k, t, rank]
        return top_ids, top_logprobs


@functools.lru_cache(maxsize=4)
def load_beam_replay(path: str) -> BeamReplay:
    """The BeamReplay of `path`, read once per process (every simulated point of a sweep shares it)."""
    return BeamReplay(path)
