"""The compile grid: after `compile_grid`, a mixed load (prompt lengths, n > 1, beams, logprobs of
several widths, prompt logprobs, top_k, top_p, min_p, seeds, every sampling control alone and
together: penalties, logit_bias, min_tokens and bad words, allowed tokens; swap preemption) compiles
nothing: neither the engine's count nor JAX's own compile events move. The sampler is one program
per row count."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import startup
from jpaged.config.presets import get_preset
from jpaged.core import padding
from jpaged.core.constraints import bitmask_words
from jpaged.core.sampling_controls import SamplingControls
from jpaged.core.sequence import SamplingParams, active_controls
from jpaged.core.step_plan import SamplingBatch, StepPlan
from jpaged.entrypoints.engine_args import engine_config, load_engine
from jpaged.executors import sampling, warmup
from jpaged.models import decoder, executable_store
from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir

REPO = Path(__file__).resolve().parents[2]
# Small enough to compile its whole grid in seconds, tight enough in blocks to preempt by swapping.
SMALL = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64, "block_size": 8, "num_blocks": 20,
         "num_host_blocks": 16, "preemption_mode": "swap", "attention_backend": "xla"}


@contextlib.contextmanager
def backend_compiles():
    """The list of JAX backend compilations (XLA compiles, disk-cache hits too) while inside."""
    events: list[str] = []

    def listen(name: str, duration: float, **kwargs) -> None:
        if name in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def _mixed_requests(rng: random.Random, count: int, prompt_logprobs: bool = False
                    ) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(count):
        prompts.append([rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))])
        kind = i % 5
        if kind == 0:  # beam search: top candidates, forks, copy-on-write
            params.append(SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=rng.randrange(2, 12),
                                         ignore_eos=True))
            continue
        # Every draw mode (top_k up to and past the candidate limit), min_p, seeds, logprobs of several
        # widths, and any mix of the controls: penalties, logit_bias, banned ids (min_tokens, bad
        # words), allowed tokens.
        controls = {}
        extra = {"prompt_logprobs": rng.choice([None, 0, 3, 20])} if prompt_logprobs else {}
        for name, value in [("repetition_penalty", 1.2), ("frequency_penalty", 0.5), ("presence_penalty", -0.5),
                            ("logit_bias", {rng.randrange(256): rng.uniform(-5, 5) for _ in range(rng.randrange(1, 9))}),
                            ("min_tokens", 2), ("bad_words_token_ids", [[rng.randrange(256)], [7, 9]]),
                            ("allowed_token_ids", rng.sample(range(256), rng.randrange(2, 40)))]:
            if rng.random() < 0.3:
                controls[name] = value
        params.append(SamplingParams(
            n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 0.8, 1.0]),
            top_k=rng.choice([0, 0, 5, 50, 100]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
            seed=rng.choice([None, i]), logprobs=rng.choice([None, 0, 1, 5, 20]), max_tokens=rng.randrange(3, 24),
            ignore_eos=True, **controls, **extra))
    return prompts, params


def test_grid_covers_mixed_load_without_compiling(caplog):
    engine, _ = load_engine("tiny-llama", **SMALL)
    programs = warmup.grid(engine.config)
    with caplog.at_level(logging.INFO, logger="jpaged.executors.warmup"):
        report = warmup.compile_grid(engine.executor, engine.config, progress=False)
    # Every program of the grid counted once: the executor's keys are the grid's.
    assert report["num_compilations"] == report["num_programs"] == len(programs)
    # The log line the start-up benchmark reads the program count from (experiments.bench.startup)
    assert int(startup._GRID_LINE.search(caplog.text)[1]) == len(programs)
    # One sampler program per step row count, whatever the requests ask.
    seq_sizes = {p.num_seqs for p in programs if isinstance(p, warmup.ModelStep)}
    assert sorted(p.num_rows for p in programs if isinstance(p, sampling.SamplerProgram)) == sorted(seq_sizes)
    warm = engine.kv_stats()["num_compilations"]
    rng, used, prompt_logprobs_seen = random.Random(0), set(), 0
    with backend_compiles() as compiles:
        for load in range(4):  # the last with prompt logprobs (prompt chunks of every size, decode-shaped steps too)
            prompts, params = _mixed_requests(rng, 12, prompt_logprobs=load == 3)
            outputs = engine.generate(prompts, params, use_tqdm=False)
            assert all(out.finished for out in outputs)
            used |= {name for p in params for name in active_controls(p)}
            prompt_logprobs_seen += sum(out.prompt_logprobs is not None and len(out.prompt_token_ids) > 1
                                        for out in outputs)
    assert used == {"repetition_penalty", "frequency_penalty", "presence_penalty", "logit_bias", "min_tokens",
                    "min_p", "bad_words_token_ids", "allowed_token_ids"}
    assert prompt_logprobs_seen  # (prompt rows in steps with a prompt chunk, with and without top candidates)
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0  # the load did preempt (swap)
    assert stats["num_compilations"] == warm
    assert compiles == []


@pytest.mark.slow  # a whole grid twice over (target and draft): 40 s on 2 cores
def test_grid_covers_a_draft_models_programs(tmp_path):
    """With a draft model (here the target itself): its steps, its draft loop and its pool's
    copies are in the grid, and verify steps then compile nothing."""
    spec = get_preset("tiny-llama")
    write_hf_dir(tmp_path / "draft", spec, decoder.init_params(spec, seed=0), HF_CONFIGS["tiny-llama"])
    engine, _ = load_engine("tiny-llama", **SMALL, speculative_config={
        "method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3,
        "disable_by_batch_size": 3})
    programs = warmup.grid(engine.config)
    # verify steps of <= 2 sequences: S = 1 and 2
    assert sorted(p.num_seqs for p in programs if isinstance(p, warmup.DraftLoop)) == [1, 2]
    report = warmup.compile_grid(engine.executor, engine.config, progress=False)
    assert report["num_compilations"] == report["num_programs"] == len(programs)
    rng = random.Random(1)
    # One greedy request (3 drafts a step), two samples forking a prompt (copy-on-write in both
    # pools), two greedy requests (1 draft each a step), then three (speculation off, the draft
    # resting) of which two end early: the last one's draft K/V catches up before it drafts.
    loads = [[SamplingParams(max_tokens=20, ignore_eos=True)],
             [SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)],
             [SamplingParams(max_tokens=12, ignore_eos=True)] * 2,
             [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 5, 20)]]
    plans = []
    launch = engine.executor.launch
    engine.executor.launch = lambda plan: plans.append(plan) or launch(plan)
    with backend_compiles() as compiles:
        for params in loads:
            prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))] for _ in params]
            assert all(out.finished for out in engine.generate(prompts, params, use_tqdm=False))
    assert any(not p.draft_mirror for p in plans) and any(p.draft_catchup is not None for p in plans)
    stats = engine.kv_stats()
    assert stats["spec_accepted_per_pos"][2] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["num_compilations"] == report["num_compilations"]
    assert compiles == []


def test_unwarmed_engine_counts_sampler_and_block_programs(monkeypatch):
    """Without the warm-up the same load compiles, and the count includes the sampler's programs."""
    monkeypatch.setattr(executable_store, "_store", None)  # compiled here, not loaded from another test's
    engine, _ = load_engine("tiny-llama", **SMALL)
    prompts, params = _mixed_requests(random.Random(0), 6)
    with backend_compiles() as compiles:
        engine.generate(prompts, params, use_tqdm=False)
    model_steps = engine.executor.runner.num_compilations
    assert engine.kv_stats()["num_compilations"] > model_steps > 0
    assert compiles  # (the listener the first test relies on hears them)


@pytest.mark.parametrize("block_size", [16, 32])  # the server's default and the benchmark's
def test_grid_is_one_model_step_per_token_bucket(block_size):
    """The grid's model steps are exactly the ragged shapes of the token counts a step can have,
    and every plan the scheduler can build is brought to one of them."""
    cfg = engine_config("tiny-llama", max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=512,
                        block_size=block_size)
    steps = warmup.model_steps(cfg)
    max_blocks = -(-cfg.scheduler.max_model_len // cfg.cache.block_size)
    pow2 = lambda n: 1 << (n - 1).bit_length()
    expected = {(padding.bucket(t), min(pow2(padding.bucket(t)), 256), max_blocks) for t in range(1, 2049)}
    assert {(s.num_tokens, s.num_seqs, s.table_width) for s in steps} == expected
    assert len(steps) == len(expected) == 17  # 8, 12, 16, 24, ... 1,536, 2,048: two per doubling
    # Any plan: n sequences computing t >= n tokens, S and M as the plan builders pad them.
    shapes = {(s.num_tokens, s.num_seqs, s.table_width) for s in steps}
    for n, t in [(1, 1), (5, 5), (9, 10), (200, 200), (256, 256), (256, 2048), (3, 1500), (1, 2048)]:
        tokens = np.zeros(padding.bucket(t), np.int32)
        plan = StepPlan(num_seqs=n, num_tokens=t, max_query_len=2, token_ids=tokens, positions=tokens,
                        slot_mapping=tokens,
                        query_start_loc=np.zeros(padding.seq_bucket(n) + 1, np.int32),
                        context_lens=np.zeros(padding.seq_bucket(n), np.int32),
                        block_tables=np.zeros((padding.seq_bucket(n), 3), np.int32),
                        logits_indices=np.zeros(padding.seq_bucket(n), np.int32))
        assert plan.to_ragged(256, max_blocks).padded_shape in shapes


_CACHE_SCRIPT = """
import json, jax
from jpaged.executors import sampling, warmup
from jpaged.models import executable_store
path = warmup.enable_compilation_cache()
hits, writes = [], []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("cache_hits") else None)
# (JAX's "cache_misses" event: a compiled program written to the disk cache)
jax.monitoring.register_event_listener(
    lambda name, **kw: writes.append(name) if name.endswith("cache_misses") else None)
from jpaged.entrypoints.engine_args import load_engine
engine, _ = load_engine("tiny-llama", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8,
                        num_blocks=20, attention_backend="xla")
report = warmup.compile_grid(engine.executor, engine.config, progress=False)
store = executable_store.current()
stored = [p for p in warmup.grid(engine.config) if not isinstance(p, warmup.BlockOp)]
print(json.dumps({"path": str(path), "hits": len(hits), "writes": len(writes), "stored_programs": len(stored),
                  "loaded": store.loaded, "saved": store.saved, "num_compilations": report["num_compilations"]}))
"""


def _start(cache: Path) -> dict:
    """A fresh process compiling the small grid with JPAGED_CACHE_DIR=`cache`: its cache events."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_PERSISTENT_CACHE")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # (the test session's own cache: conftest.py)
    env.pop("XLA_FLAGS", None)  # one device, whatever another test of this worker put there (stored programs)
    env.update(JPAGED_CACHE_DIR=str(cache), JAX_PLATFORMS="cpu")
    return json.loads(subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], cwd=REPO, env=env, check=True,
                                     capture_output=True, text=True).stdout.splitlines()[-1])


def test_restart_and_a_moved_cache_load_the_grid_from_the_disk_cache(tmp_path):
    """$JPAGED_CACHE_DIR holds the compiled grid: a second process loads its model steps and
    sampler programs from the executable store (no tracing) and compiles nothing; so does one
    started on a copy of the folder at another path (no key holds the folder's path)."""
    first = tmp_path / "first"
    runs = [_start(first), _start(first)]
    assert runs[0]["path"] == str(first / "jax")
    # The first start compiles every program (XLA's cache gets them too) and stores the model
    # steps and sampler programs; the restart loads each of those and compiles nothing new.
    assert runs[0]["hits"] == 0 and runs[0]["loaded"] == 0 and runs[0]["saved"] == runs[0]["stored_programs"]
    # (XLA's cache may still take a block operation's program: one that compiled faster than
    # MIN_CACHED_COMPILE_S was not written at first, and under load it may compile slower.)
    assert runs[1]["loaded"] == runs[0]["saved"] and runs[1]["saved"] == 0
    assert runs[0]["num_compilations"] == runs[1]["num_compilations"]
    entries = {p.relative_to(first) for p in first.rglob("*.bin")}
    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    run = _start(moved)
    assert run["loaded"] == runs[0]["saved"] and run["saved"] == 0
    assert entries == {p.relative_to(moved) for p in moved.rglob("*.bin")}


def test_a_cache_jax_already_has_is_kept():
    """conftest.py gives this session its own cache through JAX_COMPILATION_CACHE_DIR: it stays."""
    before = jax.config.jax_compilation_cache_dir
    assert before and warmup.enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir == before


def test_more_sample_rows_than_the_steps_sequences_are_sampled_in_slices_alike():
    """A fresh prompt fanning out can give a step more sample rows than its S: the executor samples
    them S at a time (the sampler variant stays the step's); every row gets what one call over
    wider logits gives it."""
    engine, _ = load_engine("tiny-llama", **SMALL)
    vocab, rng = engine.vocab_size, np.random.default_rng(0)
    logits = rng.normal(size=(8, vocab)).astype(np.float32)  # [S, V]: a step of 8 padded sequences
    rows = 20
    batch = SamplingBatch(logits_rows=rng.integers(0, 8, rows).astype(np.int32),
                          temperature=rng.choice([0.0, 1.0], rows).astype(np.float32),
                          top_k=rng.choice([0, 5], rows).astype(np.int32), top_p=np.ones(rows, np.float32),
                          seed=np.arange(rows, dtype=np.uint32), stream=np.arange(rows, dtype=np.int32),
                          position=np.full(rows, 7, np.int32), num_top=5,
                          min_p=rng.choice([0.0, 0.1], rows).astype(np.float32))
    # Controls split with the rows: penalties on every row, rows 3 and 17 restricted to tokens 0..63.
    allowed_rows = np.array([3, 17], np.int32)
    masks = np.zeros((2, bitmask_words(vocab)), np.int32)
    masks[:, :2] = -1
    batch.controls = SamplingControls(
        penalties=np.tile(np.array([0.5, 0.2, 1.3], np.float32), (rows, 1)),
        history=rng.integers(0, vocab, (rows, 16)).astype(np.int32), output_start=np.full(rows, 4, np.int32),
        allowed_rows=allowed_rows, allowed_masks=masks)
    sliced = engine.executor.sample(jnp.asarray(logits), batch)
    wide = np.concatenate([logits, np.zeros((24, vocab), np.float32)])  # [32, V]: room for every row at once
    whole = sampling.sample(jnp.asarray(wide), batch)
    for field in ("token_ids", "top_ids"):
        np.testing.assert_array_equal(getattr(sliced, field), getattr(whole, field))
    for field in ("logprobs", "top_logprobs"):  # (another program shape: the last bit may round differently)
        np.testing.assert_allclose(getattr(sliced, field), getattr(whole, field), rtol=1e-6, atol=1e-6)


def test_compile_grid_stops_between_programs_when_told(monkeypatch):
    engine, _ = load_engine("tiny-llama", **SMALL)
    stop = threading.Event()
    prepare_model = engine.executor.prepare_model

    def prepare_then_stop(plan, draft=False):  # the first program is readied (and compiles), then a shutdown asks to stop
        ready = prepare_model(plan, draft)
        stop.set()
        return ready

    monkeypatch.setattr(engine.executor, "prepare_model", prepare_then_stop)
    with pytest.raises(warmup.WarmUpStopped, match=rf"after 1 of {len(warmup.grid(engine.config))}"):
        warmup.compile_grid(engine.executor, engine.config, progress=False, stop=stop)
    assert engine.executor.num_compilations == 1 and not engine.executor.warmed_up
