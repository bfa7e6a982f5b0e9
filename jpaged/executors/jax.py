"""The real executor: block operations on the KV pool, then the jitted model step, on CPU or GPU(s).

The device pool is a `(k_pool, v_pool)` pair `[L, Hkv, N, Bs, D]`; the host pool (swap space and
the prefix cache's host tier) has the same layout in host (numpy) memory. After the model step,
the plan's sample rows are sampled on device (jpaged.executors.sampling): only token ids and
log-probabilities come back to the host; a plan's prompt rows become prompt log-probabilities in
the model step's own program (jpaged.executors.prompt_logprobs). Every plan runs at the ragged
shape of its token count (`StepPlan.to_ragged`): one model program per token bucket. Block
operations run in the order the scheduler relies on: copies out (the host tier's offloads, then
swap-outs; both free device blocks, and a swap-out may reuse a host block the tier gave back),
copies in (swapped groups and promoted prefix-cache
blocks; they may reuse the freed device blocks), copy-on-write, then the model writes.
Pair arrays are padded to buckets so block operations do not recompile either. Every program a
config can need (model steps, the sampler's one program per row count, block operations) is
compiled before serving by jpaged.executors.warmup; `num_compilations` counts the distinct ones this executor has run.

With `model.tensor_parallel_size > 1` (jpaged.models.parallel) the weights and the pool are split over a
device mesh by head; block ids are the same on every device. The host swap space of a process holds
the KV heads of that process's devices (all heads on a single host): swap moves each device's own
shard of the blocks, so multi-host runs never gather another host's heads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import EngineConfig
from jpaged.config.presets import ModelSpec, get_preset
from jpaged.core import padding
from jpaged.core.step_plan import ModelOutput, SamplingBatch, StepPlan
from jpaged.executors import drafting, kv_sizing, prompt_logprobs, sampling
from jpaged.executors.base import PendingStep
from jpaged.models import decoder, parallel
from jpaged.models.checkpoint import load_params, resolve_dtype
from jpaged.models.kv_pool import KVPool, init_kv_pool, storage_dtype
from jpaged.models.runner import ModelRunner, PromptScores
from pallas_kernels import cache_ops
from pallas_kernels.backends import resolve_backend

logger = logging.getLogger(__name__)


def _padded(ids: np.ndarray, size: int) -> np.ndarray:
    """i32[size]: `ids` then zeros (block 0, the reserved padding target)."""
    out = np.zeros(size, np.int32)
    out[: len(ids)] = ids
    return out


def _host_bytes() -> int:
    """Physical memory of this host."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_bytes() -> int:
    """Memory of this process's first JAX device (its bytes_limit), or the host's where devices report
    none (CPU). A local device: in a multi-host run `jax.devices()[0]` may be another process's, and
    `memory_stats()` of a non-addressable device raises."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit") or _host_bytes()


def _check_fits(field: str, num_blocks: int, block_bytes: int, limit: int, where: str) -> None:
    """A pool that cannot fit is a ValueError naming its config field, not an allocation failure."""
    if num_blocks * block_bytes > limit:
        raise ValueError(f"{field}: {num_blocks} blocks of {block_bytes:,} bytes need "
                         f"{num_blocks * block_bytes / 2**30:,.1f} GiB, more than the {limit / 2**30:,.1f} GiB of "
                         f"{where}")


class JaxExecutor:
    """Runs StepPlans on the real model with a paged KV pool on the default JAX device(s)."""

    def __init__(self, config: EngineConfig, params: decoder.Params | None = None, *,
                 memory: Callable[[], kv_sizing.DeviceMemory] = kv_sizing.device_memory):
        """`params` overrides config.model (dummy seeded weights or a local checkpoint). `memory`:
        where a pool sized from gpu_memory_utilization reads the device's memory (`kv_cache` is
        the size it got; jpaged.executors.kv_sizing).

        Weights are loaded straight into their shards (jpaged.models.checkpoint.load_params): with
        tensor parallelism no device ever holds a whole model. `params` given in memory are
        placed on the mesh here.
        """
        model, cache = config.model, config.cache
        if model.num_processes > 1:  # before any other JAX work
            parallel.initialize_distributed(model.coordinator_address, model.num_processes, model.process_id)
        tp = model.tensor_parallel_size
        self.mesh = parallel.make_mesh(tp) if tp > 1 else None
        self.dtype = resolve_dtype(model.dtype)
        if params is None:
            # With fewer KV heads than devices each is replicated: the pool then has `tp` KV heads.
            self.spec, params = load_params(model, self.mesh)
        else:
            self.spec, params = parallel.replicate_kv_heads(get_preset(model.name), params, tp)
            if self.mesh is not None:
                params = parallel.shard_params(self.spec, params, self.mesh)
        # Bytes of one block (K and V, every layer) on one device: its share of the KV heads.
        block_bytes = (2 * self.spec.num_layers * (self.spec.num_kv_heads // tp) * cache.block_size
                       * self.spec.head_dim * self.dtype.itemsize)
        # bfloat16 on CPU is stored as its bits (kv_pool.storage_dtype); the host swap space alike.
        self.kv_dtype = storage_dtype(self.dtype, attention_backend=resolve_backend(model.attention_backend))
        self.block_size = cache.block_size
        self.runner = ModelRunner(self.spec, params, block_size=cache.block_size,
                                  attention_backend=model.attention_backend, mesh=self.mesh)
        del params  # the runner may hold its own copy (per-layer weights): the stacked tree goes before sizing
        # speculative.method draft_model: loaded before sizing, so that its weights are out of the
        # memory the pool is sized from; its pool has as many blocks as the target's (the same
        # tables), so a block of the budget costs both models' K/V.
        draft = drafting.load_draft(config, self.spec) if config.speculative.method == "draft_model" else None
        draft_block_bytes = 0 if draft is None else draft[0].kv_bytes_per_token(self.dtype) * self.block_size
        # cache.num_blocks, or sized from memory now that the weights are in it (jpaged.executors.kv_sizing).
        self.kv_cache = kv_sizing.kv_cache_size(
            config, block_bytes + draft_block_bytes, memory,
            lambda: kv_sizing.activation_bytes(self.runner, config, self._make_pool(2)))
        field = ("cache.num_blocks" if cache.num_blocks is not None else "cache.kv_cache_memory_bytes"
                 if cache.kv_cache_memory_bytes is not None else "cache.gpu_memory_utilization")
        _check_fits(field, self.kv_cache.num_blocks, block_bytes, _device_bytes(), "device memory")
        self.kv_pool = self._make_pool(self.kv_cache.num_blocks)
        logger.info(self.kv_cache.describe())
        # speculative.method draft_model: the draft's runner and its own pool of as many blocks
        # (jpaged.executors.drafting), else None.
        self.draft_runner: ModelRunner | None = None
        self.draft_pool: KVPool | None = None
        self.draft_host: tuple[np.ndarray, np.ndarray] | None = None  # its host pool, blocks as the target's
        self.num_speculative_tokens = config.speculative.num_speculative_tokens
        # The KV heads this process's devices hold: a contiguous range of the head axis.
        shards = self.kv_pool[0].sharding.addressable_devices_indices_map(self.kv_pool[0].shape)
        heads = [range(self.spec.num_kv_heads)[index[1]] for index in shards.values()]
        self._first_head = min(h.start for h in heads)
        num_local = max(h.stop for h in heads) - self._first_head
        num_host = cache.num_host_blocks + cache.num_host_cache_blocks  # one pool: swap space + host tier
        shape = (self.spec.num_layers, num_local, num_host, cache.block_size, self.spec.head_dim)
        _check_fits("cache.num_host_cache_blocks" if cache.num_host_cache_blocks else "cache.num_host_blocks",
                    num_host, 2 * int(np.prod(shape[:2] + shape[3:])) * self.dtype.itemsize, _host_bytes(),
                    "host memory")
        self.host_k = np.zeros(shape, dtype=self.kv_dtype)  # [L, local Hkv, H, Bs, D] host pool in host memory
        self.host_v = np.zeros(shape, dtype=self.kv_dtype)
        if draft is not None:
            self._start_draft(config, *draft, num_host)
        self.vocab_size = self.spec.vocab_size  # token ids the engine accepts
        # The fixed widths of the sampler's per-row data: one sampler program per row count.
        self.sampler_widths = sampling.sampler_widths(config.scheduler.max_model_len, config.scheduler.max_num_seqs,
                                                      self.vocab_size)
        # Every plan runs at the ragged shape of its token count (jpaged.core.padding.ragged_shape).
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_blocks_per_seq = -(-config.scheduler.max_model_len // cache.block_size)
        # The sampler programs and (operation, padded size) block operations this executor has run:
        # their jitted functions are shared by every executor of the process, so their own trace
        # counts would mix engines.
        self._programs: set[tuple] = set()
        self.warmed_up = False  # set by jpaged.executors.warmup.compile_grid: later new programs are logged
        self._start = time.perf_counter()

    @property
    def has_draft_model(self) -> bool:
        """True when this executor drafts with a draft model (speculative.method draft_model)."""
        return self.draft_runner is not None

    def _start_draft(self, config: EngineConfig, spec: ModelSpec, params: decoder.Params, num_host: int) -> None:
        """The draft model's runner, its pool and its host pool (of `num_host` blocks): the
        target's block counts, block size and dtype."""
        block_bytes = spec.kv_bytes_per_token(self.dtype) * self.block_size  # one device: every KV head
        _check_fits("speculative.model", self.kv_cache.num_blocks, block_bytes, _device_bytes(),
                    "device memory (the draft's pool)")
        _check_fits("speculative.model", num_host, block_bytes, _host_bytes(), "host memory (the draft's host pool)")
        shape = (spec.num_layers, spec.num_kv_heads, num_host, self.block_size, spec.head_dim)
        self.draft_host = (np.zeros(shape, self.kv_dtype), np.zeros(shape, self.kv_dtype))
        self.draft_runner = ModelRunner(spec, params, block_size=self.block_size,
                                        attention_backend=config.model.attention_backend)
        pool = init_kv_pool(spec, self.kv_cache.num_blocks, self.block_size, self.kv_dtype)
        self.draft_pool = jax.device_put(pool, jax.local_devices()[0])
        logger.info("draft model %s: %d layers, %d KV heads, pool of %d blocks (%.1f MiB)", config.speculative.model,
                    spec.num_layers, spec.num_kv_heads, self.kv_cache.num_blocks,
                    self.kv_cache.num_blocks * block_bytes / 2**20)

    def _make_pool(self, num_blocks: int) -> tuple[jax.Array, jax.Array]:
        """A zeroed device pool of `num_blocks` blocks, on this process's device or split over the mesh."""
        make_pool = functools.partial(init_kv_pool, self.spec, num_blocks, self.block_size, self.kv_dtype)
        if self.mesh is None:
            # Committed to the device from birth, as every pool a step returns is: jit keys its
            # programs on that too, and an uncommitted first pool compiled each step twice.
            return jax.device_put(make_pool(), jax.local_devices()[0])
        pools = parallel.pool_sharding(self.mesh)
        return jax.jit(make_pool, out_shardings=(pools, pools))()  # born sharded, never whole

    @property
    def num_compilations(self) -> int:
        """Distinct programs run so far: model steps (one per padded shape, counted as traced; the
        draft model's steps and draft loops too), sampler programs (one per row count) and
        block-operation sizes."""
        drafts = 0 if self.draft_runner is None else self.draft_runner.num_compilations
        return self.runner.num_compilations + drafts + len(self._programs)

    def now(self) -> float:
        """Seconds since the executor was built."""
        return time.perf_counter() - self._start

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Applies offloads, swap-outs, swap-ins and copy-on-write, runs the step and samples on device."""
        # Host-side inputs first: if a request's sampling settings cannot become device arrays, this
        # raises before any state changed, and the engine can fail that request and run the plan again.
        batch = None if plan.sampling is None else plan.sampling.batch
        return self._finish(self.launch(plan), batch)

    def launch(self, plan: StepPlan) -> PendingStep:
        """Applies the block operations and dispatches the model step; its logits stay on device and
        the call returns before they are computed (JAX dispatches asynchronously)."""
        start = self.now()
        k_pool, v_pool = self.kv_pool
        for pairs in (plan.offload_pairs, plan.swap_out_pairs):
            if len(pairs):
                self._swap_out(k_pool, v_pool, pairs)
                if self.draft_pool is not None:
                    self._swap_draft_out(pairs)
        if len(plan.swap_in_pairs):
            k_pool, v_pool = self._swap_in(k_pool, v_pool, plan.swap_in_pairs)
            if self.draft_pool is not None:
                self._swap_draft_in(plan.swap_in_pairs)
        if len(plan.copy_pairs):
            size = padding.pair_bucket(len(plan.copy_pairs))
            self._programs.add(("copy_blocks", size))
            pairs = np.zeros((size, 2), np.int32)
            pairs[: len(plan.copy_pairs)] = plan.copy_pairs
            k_pool, v_pool = cache_ops.copy_blocks(k_pool, v_pool, jnp.asarray(pairs))
            if self.draft_pool is not None:  # a program of its own: the draft's pool has its own shape
                self._programs.add(("draft_copy_blocks", size))
                self.draft_pool = cache_ops.copy_blocks(*self.draft_pool, jnp.asarray(pairs))
        self.kv_pool = (k_pool, v_pool)  # the old pool was donated: never keep a reference to it
        if self.draft_runner is not None and plan.num_seqs:
            if plan.draft_catchup is not None:  # the draft K/V of steps run without it (core.sched.draft_mirror)
                self._run_draft_model(plan.draft_catchup)
            if plan.sampling is not None and plan.sampling.spec_offsets is not None:
                plan = self._drafted(plan)  # the draft loop wrote the draft's K/V of the plan's tokens
            elif plan.draft_mirror:
                self._run_draft_model(plan)  # the draft's pool keeps the K/V of the tokens it may draft from
        # (logits f32[S, V], prompt scores or None), on device
        handle = self._run_model(plan) if plan.num_seqs else None
        return PendingStep(plan, start, handle)

    def _drafted(self, plan: StepPlan) -> StepPlan:
        """Verify plan `plan` with its placeholder drafts replaced by the draft model's greedy
        ones: one draft-loop program, one copy of its tokens to the host
        (jpaged.executors.drafting)."""
        inputs = drafting.draft_inputs(plan, self.num_speculative_tokens, self.max_blocks_per_seq)
        picked, self.draft_pool = self.draft_runner.draft(
            self.draft_pool, inputs.first_tokens, inputs.positions, inputs.slot_mapping, inputs.context_lens,
            inputs.block_tables, inputs.num_steps)
        return drafting.with_drafts(plan, inputs, np.asarray(picked))

    def _run_draft_model(self, plan: StepPlan) -> jax.Array:
        """The draft model's step of `plan` on its pool: its logits f32[S, vocab], on device."""
        logits, self.draft_pool = self.draft_runner.step(self.draft_pool,
                                                         plan.to_ragged(self.max_num_seqs, self.max_blocks_per_seq))
        return logits

    def collect(self, pending: PendingStep) -> ModelOutput:
        """Samples the plan's rows (as they are now) on device and reduces its prompt rows to prompt
        log-probabilities; only tokens and log-probabilities come back."""
        rows = pending.plan.sampling
        return self._finish(pending, None if rows is None else rows.batch)

    def _finish(self, pending: PendingStep, batch: SamplingBatch | None) -> ModelOutput:
        """`collect` with the sample rows' arrays already built (`batch`, None when nobody samples)."""
        plan = pending.plan
        logits, scores = pending.handle or (None, None)
        prompt_result = None if scores is None else prompt_logprobs.picked(scores, plan.prompt_rows)
        output = ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=0.0)
        if logits is not None and batch is not None:
            sampled = self.sample(logits, batch)
            output = ModelOutput(token_ids=sampled.token_ids, logprobs=sampled.logprobs, top_ids=sampled.top_ids,
                                 top_logprobs=sampled.top_logprobs, duration=0.0)
        elif logits is not None:  # only prompt chunks that do not reach their ends: nothing to sample
            logits.block_until_ready()
        if self.draft_runner is not None and batch is not None and plan.sampling.spec_offsets is not None:
            output.drafts = drafting.checked_drafts(plan.sampling, plan.token_ids)
        output.prompt_logprobs = prompt_result
        output.duration = self.now() - pending.started
        return output

    def run_model(self, plan: StepPlan, draft: bool = False) -> jax.Array:
        """The jitted model step of `plan` (no block operations) on the pool: logits f32[S, vocab]
        on device, S the ragged S of the plan's T. `draft`: the draft model's, on its pool."""
        return self._run_draft_model(plan) if draft else self._run_model(plan)[0]

    def _run_model(self, plan: StepPlan) -> tuple[jax.Array, PromptScores | None]:
        """`run_model`, with the prompt scores of `plan.prompt_rows` (on device) when it has some."""
        plan = plan.to_ragged(self.max_num_seqs, self.max_blocks_per_seq)
        if plan.prompt_rows is None:
            logits, self.kv_pool = self.runner.step(self.kv_pool, plan)
            return logits, None
        targets = prompt_logprobs.targets(plan.prompt_rows, len(plan.token_ids))
        logits, scores, self.kv_pool = self.runner.step_with_prompt_scores(self.kv_pool, plan, targets,
                                                                           plan.prompt_rows.num_top > 0)
        return logits, scores

    def prepare_model(self, plan: StepPlan, draft: bool = False) -> Callable[[], None]:
        """Readies the model step of `plan`'s ragged shape without running it: its stored
        executable is found, or the step traced and lowered, now; the returned call (on any
        thread) loads or compiles the program `run_model` of that shape runs. `draft`: the draft
        model's, on its pool."""
        runner, pool = (self.draft_runner, self.draft_pool) if draft else (self.runner, self.kv_pool)
        return runner.prepare(pool, plan.to_ragged(self.max_num_seqs, self.max_blocks_per_seq))

    def prepare_draft_loop(self, num_seqs: int) -> Callable[[], None]:
        """`prepare_model` for the draft loop of `num_seqs` padded sequences
        (jpaged.executors.drafting), on padding: the program verify steps of that S run."""
        k, size = self.num_speculative_tokens + 1, num_seqs
        steps = np.zeros((k, size), np.int32)
        return self.draft_runner.prepare_draft(self.draft_pool, np.zeros(size, np.int32), steps, steps,
                                               np.ones((k, size), np.int32),
                                               np.zeros((size, self.max_blocks_per_seq), np.int32), 0)

    def sample(self, logits: jax.Array, batch: SamplingBatch) -> sampling.SampleResult:
        """Samples `batch` from `logits` [S, vocab], at most S rows a call: the step's shape fixes the
        sampler's. (More rows than S only where a fresh prompt fans out into n samples; each row's
        draw depends on its own settings alone, so splitting changes no token.)"""
        size = logits.shape[0]
        self._count(sampling.SamplerProgram(size))
        results = [sampling.sample(logits, part, self.sampler_widths) for part in sampling.split_rows(batch, size)]
        if len(results) == 1:
            return results[0]
        fields = [f.name for f in dataclasses.fields(sampling.SampleResult)]
        return sampling.SampleResult(**{f: None if getattr(results[0], f) is None else
                                        np.concatenate([getattr(r, f) for r in results]) for f in fields})

    def _count(self, program: sampling.SamplerProgram) -> None:
        """Counts a sampler program in `num_compilations`, with a warning
        when it is new after the warm-up: outside the start-up grid (jpaged.executors.warmup)."""
        key = (type(program).__name__, *program)
        if key not in self._programs and self.warmed_up:
            logger.warning("%s compiles on first use", program)
        self._programs.add(key)

    def _local_heads(self, index: tuple[slice, ...]) -> slice:
        """This process's host-pool slice of the global head range `index[1]` of a shard."""
        heads = range(self.spec.num_kv_heads)[index[1]]
        return slice(heads.start - self._first_head, heads.stop - self._first_head)

    def _swap_out(self, k_pool, v_pool, pairs: np.ndarray) -> None:
        size = padding.pair_bucket(len(pairs))
        self._programs.add(("swap_out", size))
        device_ids = jnp.asarray(_padded(pairs[:, 0], size))
        n, host_ids = len(pairs), pairs[:, 1]
        for pool, host in ((k_pool, self.host_k), (v_pool, self.host_v)):
            blocks = cache_ops.gather_blocks(pool, device_ids)  # [L, Hkv, size, Bs, D], split by head
            for shard in blocks.addressable_shards:  # each device copies out its own heads
                host[:, self._local_heads(shard.index), host_ids] = np.asarray(shard.data)[:, :, :n]

    def _swap_draft_out(self, pairs: np.ndarray) -> None:
        """`_swap_out` of the draft model's pool (on one device) into its host pool."""
        size = padding.pair_bucket(len(pairs))
        self._programs.add(("draft_swap_out", size))
        device_ids = jnp.asarray(_padded(pairs[:, 0], size))
        for pool, host in zip(self.draft_pool, self.draft_host):
            host[:, :, pairs[:, 1]] = np.asarray(cache_ops.gather_blocks(pool, device_ids))[:, :, : len(pairs)]

    def _swap_draft_in(self, pairs: np.ndarray) -> None:
        """`_swap_in` of the draft model's host pool into its pool."""
        size = padding.pair_bucket(len(pairs))
        self._programs.add(("draft_swap_in", size))
        device_ids = jnp.asarray(_padded(pairs[:, 1], size))
        updated = []
        for pool, host in zip(self.draft_pool, self.draft_host):
            blocks = np.zeros(host.shape[:2] + (size,) + host.shape[3:], host.dtype)  # [L, Hkv, size, Bs, D]
            blocks[:, :, : len(pairs)] = host[:, :, pairs[:, 0]]
            updated.append(cache_ops.scatter_blocks(pool, device_ids, jnp.asarray(blocks)))
        self.draft_pool = tuple(updated)

    def _swap_in(self, k_pool, v_pool, pairs: np.ndarray):
        size = padding.pair_bucket(len(pairs))
        self._programs.add(("swap_in", size))
        device_ids = jnp.asarray(_padded(pairs[:, 1], size))
        updated = []
        for pool, host in ((k_pool, self.host_k), (v_pool, self.host_v)):
            local = np.zeros(host.shape[:2] + (size,) + host.shape[3:], host.dtype)  # [L, local Hkv, size, Bs, D]
            local[:, :, : len(pairs)] = host[:, :, pairs[:, 0]]
            shape = pool.shape[:2] + (size,) + pool.shape[3:]
            # Each device receives only its heads' blocks, laid out like the pool it scatters into.
            blocks = jax.make_array_from_callback(
                shape, pool.sharding,
                lambda index, local=local: local[(index[0], self._local_heads(index)) + index[2:]])
            updated.append(cache_ops.scatter_blocks(pool, device_ids, blocks))
        return tuple(updated)
