"""ModelRunner: the jitted paged step, `step(params, kv_pool, plan arrays) -> (logits, kv_pool)`.

A step's input is a `StepPlan` (jpaged.core.step_plan), whose device arrays
(`StepPlan.DEVICE_ARRAYS`) go to the jitted step: the scheduler builds plans, benchmarks and tests
build them with `experiments.paged_batch.plan_from_contexts`.

The step is a pure function of the model's Flax state (`params`, a pure dict; the module is
rebuilt with `nnx.merge` while tracing) and of the pool, which goes in donated and comes back.

One jitted step serves every plan: decodes and prompt chunks in one flat token batch, per-sequence
query ranges, context lengths and block tables as data (a ragged step), attended through the paged
prefill kernels (Pallas, native CPU or XLA; a decode is a query range of one token). It donates
the KV pool, writes each layer's new K/V through the kernels' `write_kv` and attends, indexing
layer i of the stacked pool in place: a step moves only the slots it writes, never a copy of the
pool (tests/models/test_runner_in_place.py). The LM head runs at the S rows `logits_indices`
names; a step asked for prompt scores also runs it at every token row, inside the same program
behind a `lax.cond` (`step_with_prompt_scores`), so prompt log-probabilities need no program of
their own. Each distinct padded shape compiles once (the executor brings every plan of T tokens
to one shape, `StepPlan.to_ragged`), ahead of time, and is kept in the executable store when one
is open (jpaged.models.executable_store: a restart loads it without tracing); `num_compilations`
counts the programs so the engine can show that steady-state serving does not recompile. `draft`
runs several greedy decode steps of the model in one program (a `fori_loop` over the same layers,
the pool as its carry): a draft model's drafts for a verify step (jpaged.executors.drafting).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jpaged.config.presets import ModelSpec
from jpaged.core.step_plan import StepPlan
from jpaged.core import padding
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.models import decoder, layers, logprobs, packed, parallel
from jpaged.models.executable_store import StoredJit, compiler_options
from jpaged.models.kv_pool import KVPool
from pallas_kernels import cache_ops, paged_prefill
from pallas_kernels.backends import resolve_backend


# A step's prompt scores (`ModelRunner.step_with_prompt_scores`): f32[T], i32[T], i32[T, K], f32[T, K].
PromptScores = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _write_and_attend(attend_fn: Callable, q, k, v, k_pool, v_pool, slot_mapping, block_tables, context_lens,
                      query_start_loc, layer):
    """Write layer `layer`'s new K/V (k, v [T, Hkv, D]) into the stacked pool and attend with q [T, Hq, D].

    Returns (out [T, Hq, D], k_pool, v_pool). Under tensor parallelism this runs per shard, on the
    device's own heads and its own slice of the pool.
    """
    k_pool, v_pool = cache_ops.write_kv(k_pool, v_pool, k, v, slot_mapping, layer)
    out = attend_fn(q, k_pool, v_pool, block_tables, context_lens, query_start_loc, layer)
    return out, k_pool, v_pool


class ModelRunner:
    """Runs a decoder over a paged KV pool: `step` is one jitted pure function for every plan."""

    def __init__(self, spec: ModelSpec, params: decoder.Params | nnx.State | nnx.Module, *, block_size: int,
                 attention_backend: str = "auto", interpret: bool | None = None, mesh: Mesh | None = None,
                 per_layer_weights: bool | None = None, native_dense: bool | None = None):
        """`params`: the model's state (pure dict or `nnx.State`) or the `CausalLM` itself.

        `interpret` runs Pallas kernels in interpret mode (default: off GPU only). With a `mesh`
        (tensor parallelism, see jpaged.models.parallel) `params` and pools must already be sharded;
        attention runs per head shard and logits come back replicated. `per_layer_weights` keeps
        one buffer per layer and weight and unrolls the layers in the step (`decoder.unstack_layers`:
        XLA:CPU copies every weight a scan slices); None: on CPU without a mesh. The runner then
        holds that copy of the layer weights, not the stacked tree it was given. `native_dense`
        packs that copy's dense weights once for the native CPU matrix multiply (`packed`); None:
        on with per-layer weights and the `cpu_native` backend where the kernel builds.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        self.spec = spec
        self.block_size = block_size
        self.backend = resolve_backend(attention_backend)  # "auto" -> pallas on GPU, xla elsewhere
        params = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        if per_layer_weights is None:
            per_layer_weights = mesh is None and jax.default_backend() == "cpu"
        if per_layer_weights and mesh is not None:
            raise ValueError("per_layer_weights: the tensor-parallel (mesh) step keeps the stacked layout")
        self.per_layer_weights = per_layer_weights
        # params["layers"]: stacked leaves [L, ...], or (per layer) a list of L trees.
        self.params = {**params, "layers": decoder.unstack_layers(params)} if per_layer_weights else params
        if native_dense is None:
            native_dense = per_layer_weights and self.backend == "cpu_native" and packed.native_dense_reason(params) is None
        if native_dense and not per_layer_weights:
            raise ValueError("native_dense: packs the per-layer weights; needs per_layer_weights (CPU, no mesh)")
        if native_dense and (reason := packed.native_dense_reason(params)) is not None:
            raise ValueError(f"native_dense: unavailable here ({reason})")
        self.native_dense = native_dense
        # The model's graphdefs with their dense layers over packed weights (None: the model's own).
        self._graphdefs = None
        if native_dense:
            self._graphdefs = packed.graphdefs(spec, decoder.params_dtype(params))
            self.params = packed.pack_dense(spec, self.params)
        scale = layers.softmax_scale(spec)
        interpret = jax.default_backend() != "gpu" if interpret is None else interpret
        attn = functools.partial(paged_prefill.select_impl(self.backend, interpret=interpret), scale=scale)
        self.num_top = min(MAX_LOGPROBS, spec.vocab_size)  # K: the prompt scores' top candidates
        jit_kwargs: dict[str, Any] = {"donate_argnums": (1,)}
        attend = functools.partial(_write_and_attend, attn)
        if mesh is not None:
            # The pool keeps its head sharding so the donated buffers are reused in place.
            pools = parallel.pool_sharding(mesh)
            jit_kwargs["out_shardings"] = (parallel.replicated(mesh), parallel.replicated(mesh), (pools, pools))
            attend = parallel.per_head_shards(mesh, attend, num_replicated=5)
        # Everything the traced step closes over besides its arguments: with the arguments' shapes
        # and the code, what names its stored executable (jpaged.models.executable_store).
        identity = (f"{spec!r} backend={self.backend} interpret={interpret} per_layer={per_layer_weights} "
                    f"native_dense={native_dense} num_top={self.num_top}")
        self._step_fn = StoredJit(functools.partial(self._step, attend), f"model step {identity}", **jit_kwargs)
        if mesh is not None:
            jit_kwargs["out_shardings"] = (parallel.replicated(mesh), (pools, pools))
        self._draft_fn = StoredJit(functools.partial(self._draft_loop, attend), f"draft loop {identity}", **jit_kwargs)

    @property
    def num_compilations(self) -> int:
        """Distinct programs this runner has compiled or loaded: one per padded shape of the step
        and of the draft loop."""
        return len(self._step_fn.programs) + len(self._draft_fn.programs)

    @property
    def step_name(self) -> str:
        """The jitted step's name: its programs' HLO modules (and profiles) name "jit_" + this."""
        return self._step_fn.name

    def step(self, kv_pool: KVPool, plan: StepPlan) -> tuple[jax.Array, KVPool]:
        """Runs `plan`: returns (float32 logits [S, vocab] at `logits_indices`, updated pool). The
        padding rows are not the model's (zeros under the native dense kernel). The
        pool passed in is donated: use only the returned one."""
        logits, _, kv_pool = self._run(kv_pool, plan, None, False)
        return logits, kv_pool

    def step_with_prompt_scores(self, kv_pool: KVPool, plan: StepPlan, targets: np.ndarray, want_top: bool
                                ) -> tuple[jax.Array, PromptScores, KVPool]:
        """`step`, and at every token row t the scores of the token it predicts, `targets[t]`
        (i32[T]): (log-probability f32[T], rank i32[T], the K most likely ids i32[T, K] and their
        log-probabilities f32[T, K], zeros unless `want_top`), on device, by the same program
        (jpaged.models.logprobs.prompt_scores)."""
        return self._run(kv_pool, plan, targets, want_top)

    def _run(self, kv_pool: KVPool, plan: StepPlan, targets: np.ndarray | None, want_top: bool):
        args, arrays = self._arguments(kv_pool, plan, targets, want_top)
        return self._step_fn(*args, **arrays)

    def _arguments(self, kv_pool: KVPool, plan: StepPlan, targets: np.ndarray | None, want_top: bool
                   ) -> tuple[tuple, dict[str, np.ndarray]]:
        """The jitted step's checked arguments: (params, pool, targets, want_prompt, want_top) and the
        plan's arrays by name; no `targets` (None): zeros, prompt scores off."""
        arrays = self._checked(kv_pool, plan)
        num_tokens = len(arrays["token_ids"])
        if targets is None:
            targets, want_prompt = padding.zeros(num_tokens), False
        elif targets.dtype != np.int32 or targets.shape != (num_tokens,):
            raise ValueError(f"targets: expected int32 [T={num_tokens}], got {targets.dtype} {list(targets.shape)}")
        else:
            want_prompt = True
        return (self.params, kv_pool, targets, np.bool_(want_prompt), np.bool_(want_top)), arrays

    def lower(self, kv_pool: KVPool, plan: StepPlan) -> jax.stages.Lowered:
        """The step of `plan`'s shape over `kv_pool`, traced and lowered, not compiled and not run
        (for inspection: not a program of `step`'s)."""
        args, arrays = self._arguments(kv_pool, plan, None, False)
        return self._step_fn.jitted.lower(*args, **arrays)

    def prepare(self, kv_pool: KVPool, plan: StepPlan) -> Callable[[], None]:
        """Readies the step of `plan`'s shape: loads its stored executable, or traces and lowers it
        now; the returned call (on any thread) loads or compiles it for later `step`s
        (`StoredJit.prepare`)."""
        args, arrays = self._arguments(kv_pool, plan, None, False)
        return self._step_fn.prepare(*args, **arrays)

    def memory_analysis(self, kv_pool: KVPool, plan: StepPlan) -> Any:
        """XLA's memory analysis of the compiled step of `plan`'s shape over `kv_pool`, which does not
        run (None where the backend has none): its temporaries are the step's activation peak
        (jpaged.executors.kv_sizing)."""
        return self.lower(kv_pool, plan).compile(compiler_options=compiler_options()).memory_analysis()

    def _checked(self, kv_pool: KVPool, plan: StepPlan) -> dict[str, np.ndarray]:
        spec = self.spec
        expected = (spec.num_layers, spec.num_kv_heads, None, self.block_size, spec.head_dim)
        for name, pool in zip(("k_pool", "v_pool"), kv_pool):
            if pool.ndim != 5 or any(e is not None and e != d for e, d in zip(expected, pool.shape)):
                raise ValueError(f"{name}: expected [L={spec.num_layers}, Hkv={spec.num_kv_heads}, N, "
                                 f"Bs={self.block_size}, D={spec.head_dim}], got {list(pool.shape)}")
        arrays = plan.device_arrays()
        for name, arr in arrays.items():
            if arr.dtype != np.int32:
                raise ValueError(f"{name}: expected int32, got {arr.dtype}")
        num_tokens, num_seqs = len(arrays["token_ids"]), len(arrays["context_lens"])
        for name in ("positions", "slot_mapping"):
            if arrays[name].shape != (num_tokens,):
                raise ValueError(f"{name}: expected [T={num_tokens}], got {list(arrays[name].shape)}")
        for name, shape in (("query_start_loc", (num_seqs + 1,)), ("logits_indices", (num_seqs,))):
            if arrays[name].shape != shape:
                raise ValueError(f"{name}: expected {list(shape)}, got {list(arrays[name].shape)}")
        if arrays["block_tables"].ndim != 2 or arrays["block_tables"].shape[0] != num_seqs:
            raise ValueError(f"block_tables: expected [S={num_seqs}, M], got {list(arrays['block_tables'].shape)}")
        return arrays

    def _step(self, write_and_attend: Callable, params: decoder.Params, kv_pool: KVPool, targets: jax.Array,
              want_prompt: jax.Array, want_top: jax.Array, token_ids: jax.Array, positions: jax.Array,
              slot_mapping: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
              query_start_loc: jax.Array, logits_indices: jax.Array):
        # The native dense layers leave the bucket's padding rows at zero instead of computing them.
        # The real tokens are rows [0, qsl[-1]) (padding sequences' ranges are empty, at the end).
        # The logits rows in use are the leading run of `logits_indices` that increases and stays
        # below that count (a row per sequence, or per token of a verify step): the plan builders
        # pad it with row 0 or, for decodes, with the padding token rows.
        num_tokens = jnp.max(query_start_loc)
        rising = jnp.concatenate([jnp.ones(1, bool), logits_indices[1:] > logits_indices[:-1]])
        head_rows = jnp.sum(jnp.cumprod((rising & (logits_indices < num_tokens)).astype(jnp.int32)))
        with packed.rows_in_use(num_tokens):
            model, head, h, kv_pool = self._forward(write_and_attend, params, kv_pool, token_ids, positions,
                                                    slot_mapping, block_tables, context_lens, query_start_loc)
        # The LM head runs only on each sequence's sampling row: [S, H] -> [S, V].
        with packed.rows_in_use(head_rows):
            logits = model.logits(h[logits_indices], head)

        def scores():  # every token row's logits [T, V], reduced on device
            with packed.rows_in_use(num_tokens):
                return logprobs.prompt_scores(model.logits(h, head), targets, want_top, self.num_top)

        shapes = jax.eval_shape(scores)
        prompt = jax.lax.cond(want_prompt, scores, lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes))
        return logits, prompt, kv_pool

    def draft(self, kv_pool: KVPool, first_tokens: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
              context_lens: np.ndarray, block_tables: np.ndarray, num_steps: int) -> tuple[jax.Array, KVPool]:
        """Greedy decodes of every sequence, `num_steps` (<= K + 1) in one program: step j feeds
        sequence s `first_tokens[s]` (j = 0) or step j - 1's argmax, at `positions[j, s]`, writing
        its K/V to `slot_mapping[j, s]`, with `context_lens[j, s]` tokens of context (its own
        included) through `block_tables[s]` (i32[S, M]); the per-step arrays are i32[K + 1, S].
        Returns (i32[K + 1, S] each step's argmax, rows past `num_steps` zero; the updated pool),
        on device. The pool passed in is donated. One program per (K, S, M)."""
        return self._draft_fn(*self._draft_arguments(kv_pool, first_tokens, positions, slot_mapping, context_lens,
                                                     block_tables, num_steps))

    def prepare_draft(self, *args) -> Callable[[], None]:
        """`prepare` for `draft` of these arguments' shapes."""
        return self._draft_fn.prepare(*self._draft_arguments(*args))

    def _draft_arguments(self, kv_pool: KVPool, first_tokens: np.ndarray, positions: np.ndarray,
                         slot_mapping: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                         num_steps: int) -> tuple:
        """The draft loop's checked arguments, in its order."""
        arrays = (first_tokens, positions, slot_mapping, context_lens, block_tables)
        for name, arr in zip(("first_tokens", "positions", "slot_mapping", "context_lens", "block_tables"), arrays):
            if arr.dtype != np.int32:
                raise ValueError(f"{name}: expected int32, got {arr.dtype}")
        return (self.params, kv_pool, np.int32(num_steps), *arrays)

    def _draft_loop(self, write_and_attend: Callable, params: decoder.Params, kv_pool: KVPool, num_steps: jax.Array,
                    first_tokens: jax.Array, positions: jax.Array, slot_mapping: jax.Array, context_lens: jax.Array,
                    block_tables: jax.Array):
        num_seqs = first_tokens.shape[0]
        # Step j computes one token per sequence: token row s is sequence s's query range.
        query_start_loc = jnp.arange(num_seqs + 1, dtype=jnp.int32)

        def one_step(j, carry):
            tokens, pool, out = carry  # i32[S], the pool, i32[K + 1, S]
            model, head, h, pool = self._forward(write_and_attend, params, pool, tokens, positions[j],
                                                 slot_mapping[j], block_tables, context_lens[j], query_start_loc)
            picked = jnp.argmax(model.logits(h, head), axis=-1).astype(jnp.int32)  # [S, V] -> [S]
            return picked, pool, out.at[j].set(picked)

        _, kv_pool, out = jax.lax.fori_loop(0, num_steps, one_step,
                                            (first_tokens, kv_pool, jnp.zeros(positions.shape, jnp.int32)))
        return out, kv_pool

    def _forward(self, write_and_attend: Callable, params: decoder.Params, kv_pool: KVPool, token_ids: jax.Array,
                 positions: jax.Array, slot_mapping: jax.Array, block_tables: jax.Array, context_lens: jax.Array,
                 query_start_loc: jax.Array):
        """The decoder over the pool up to the LM head: (model, packed head or None, hidden [T, H],
        pool with the tokens' K/V written)."""
        spec = self.spec

        def attend(pool, i, q, k, v):
            # q [T, Hq, D], k/v [T, Hkv, D]. The stacked pool [L, Hkv, N, Bs, D] travels as the scan
            # carry and the kernels index layer i inside it: slicing the layer out and writing it
            # back would copy the whole pool every step. Only the written slots move.
            out, k_pool, v_pool = write_and_attend(q, k, v, *pool, slot_mapping, block_tables, context_lens,
                                                   query_start_loc, i)
            return out, (k_pool, v_pool)

        params, head = packed.split_head(spec, params)  # head: a tied head's packed copy, or None
        model, blocks = decoder.merge_unstacked(spec, params, self._graphdefs) if self.per_layer_weights else (
            decoder.merge(spec, params), None)
        h = model.embed_tokens(token_ids, positions)  # [T, H]
        h, kv_pool = model.run_layers(h, positions, tuple(kv_pool), attend, blocks)
        return model, head, h, kv_pool
