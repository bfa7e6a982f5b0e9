"""Tensor-parallel cases on 4 virtual CPU devices; run in a child process by test_tensor_parallel.py.

The device count must be forced before jax is imported, which the parent test process has long
done, so these run under `python -m pytest tests/models/parallel/tp_cases.py` with XLA_FLAGS set. Run
directly, the module sets the flag itself (it is imported before jax by pytest's collection).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from experiments.paged_batch import plan_from_contexts, scattered_tables  # noqa: E402
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from jpaged.config.presets import get_preset  # noqa: E402
from jpaged.core.sequence import SamplingParams  # noqa: E402
from jpaged.engine import LLMEngine  # noqa: E402
from jpaged.executors.jax import JaxExecutor  # noqa: E402
from jpaged.models import (
    decoder,  # noqa: E402
    parallel,  # noqa: E402
)
from jpaged.models.kv_pool import init_kv_pool  # noqa: E402
from jpaged.models.runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (virtual) devices")

BLOCK_SIZE = 8


def _config(model, tp, num_blocks=1 + 96 // BLOCK_SIZE, backend="xla"):
    return EngineConfig(
        model=ModelConfig(name=model, attention_backend=backend, tensor_parallel_size=tp),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, num_host_blocks=64, watermark=0.0),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=128,
                                  preemption_mode="swap"))


def _serve(model, tp):
    """Greedy requests plus one n = 3 sampled request on a pool of ~2 requests: swap and CoW happen."""
    executor = JaxExecutor(_config(model, tp))
    ops = {"swap_out": 0, "swap_in": 0, "copy": 0}
    execute = executor.execute

    def counting_execute(plan):
        ops["swap_out"] += len(plan.swap_out_pairs)
        ops["swap_in"] += len(plan.swap_in_pairs)
        ops["copy"] += len(plan.copy_pairs)
        return execute(plan)

    executor.execute = counting_execute
    engine = LLMEngine(_config(model, tp), executor=executor)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 17, 30, 9, 41, 12)]
    params = [SamplingParams(max_tokens=10)] * len(prompts)
    prompts.append(rng.integers(1, 256, size=13).tolist())  # 13 tokens: the last block is shared, then CoW
    params.append(SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=7))
    outs = engine.generate(prompts, params, use_tqdm=False)
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return [o.output_token_ids for o in outs], ops, stats["num_preemptions"]


# tiny-llama at tp = 4: 2 KV heads replicated over 4 devices; tiny-opt at tp = 2: every head split
# evenly (one tensor-parallel degree each keeps the suite's time; both layouts are covered, the
# second in the slow tier, which CI runs too).
@pytest.mark.parametrize("model, degrees", [pytest.param("tiny-opt", (2,), marks=pytest.mark.slow), ("tiny-llama", (4,))],
                         ids=["tiny-opt-tp2", "tiny-llama-tp4"])
def test_engine_outputs_equal_single_device(model, degrees):
    expected, ops, preemptions = _serve(model, 1)
    assert preemptions > 0 and ops["swap_out"] > 0 and ops["swap_in"] > 0 and ops["copy"] > 0
    for tp in degrees:
        outputs, tp_ops, tp_preemptions = _serve(model, tp)
        assert outputs == expected, tp
        assert (tp_ops, tp_preemptions) == (ops, preemptions)  # the host side is unchanged


def test_weights_and_pool_are_split_by_head_and_updated_in_place():
    executor = JaxExecutor(_config("tiny-llama", 4, num_blocks=32))
    spec = executor.spec
    assert spec.num_kv_heads == 4  # 2 KV heads, each on 2 devices
    k_pool = executor.kv_pool[0]
    assert k_pool.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert {s.data.shape for s in k_pool.addressable_shards} == {(spec.num_layers, 1, 32, BLOCK_SIZE, spec.head_dim)}
    layers = executor.runner.params["layers"]
    local = {name: layers[name]["kernel"].addressable_shards[0].data.shape for name in ("q", "o")}
    assert local["q"] == (spec.num_layers, spec.hidden_size, spec.q_size // 4)  # by head (columns)
    assert local["o"] == (spec.num_layers, spec.q_size // 4, spec.hidden_size)  # by head (rows)
    assert layers["down"]["kernel"].addressable_shards[0].data.shape[1] == spec.intermediate_size // 4

    plan = plan_from_contexts([[5, 6, 7], [8, 9]], [1, 1], [[3], [4]], BLOCK_SIZE)
    compiled = executor.runner.lower(executor.kv_pool, plan).compile()
    # The partitioner's collectives: attention output and MLP all-reduces in the layer loop (+ the
    # vocabulary-split embedding), one all-gather of the vocabulary-split logits.
    assert compiled.as_text().count("all-reduce(") >= 2
    pointers = [s.data.unsafe_buffer_pointer() for p in executor.kv_pool for s in p.addressable_shards]
    _, pool = executor.runner.step(executor.kv_pool, plan)
    assert [s.data.unsafe_buffer_pointer() for p in pool for s in p.addressable_shards] == pointers


@pytest.mark.slow  # (interpreted Pallas: 12 s; the default suite runs the kernels unsharded)
def test_pallas_kernels_run_per_shard():
    """The runner on the Pallas kernels (interpreted) with 2 shards gives the single-device logits."""
    spec0 = get_preset("tiny-llama")
    params0 = decoder.init_params(spec0, seed=1)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(1, 256, n)) for n in (21, 13)]
    tables = scattered_tables(rng, [3, 3], 12)
    prefill = plan_from_contexts([s[:-1] for s in seqs], [20, 12], tables, BLOCK_SIZE, shape=(36, 3, 3))
    decode = plan_from_contexts(seqs, [1, 1], tables, BLOCK_SIZE, shape=(4, 4, 3))
    logits = []
    for tp, backend in ((1, "xla"), (2, "pallas")):
        mesh = parallel.make_mesh(tp)
        spec, params = parallel.replicate_kv_heads(spec0, params0, tp)
        pool = jax.device_put(init_kv_pool(spec, 12, BLOCK_SIZE), parallel.pool_sharding(mesh))
        runner = ModelRunner(spec, parallel.shard_params(spec, params, mesh), block_size=BLOCK_SIZE,
                             attention_backend=backend, interpret=True, mesh=mesh)
        first, pool = runner.step(pool, prefill)
        second, pool = runner.step(pool, decode)
        logits.append((np.asarray(first[:2]), np.asarray(second[:2])))
    for single, split in zip(*logits):
        np.testing.assert_allclose(split, single, rtol=1e-4, atol=1e-4 * np.abs(single).max())


def test_too_few_devices_is_an_error_naming_the_numbers():
    with pytest.raises(ValueError, match="tensor_parallel_size: 8 needs 8 devices, found 4"):
        parallel.make_mesh(8)


@pytest.mark.parametrize("model", ["tiny-opt", "tiny-llama"])
def test_checkpoints_load_straight_into_their_shards(tmp_path, model):
    """orbax restore and the Hugging Face import at tp = 4 give the sharded, KV-replicated weights."""
    from jpaged.models.checkpoint import import_hf, restore_params, save_params
    from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir

    spec = get_preset(model)
    params = decoder.init_params(spec, seed=2)
    save_params(tmp_path / "ckpt", spec, params)
    write_hf_dir(tmp_path / "hf", spec, params, HF_CONFIGS[model])
    mesh = parallel.make_mesh(4)
    want_spec, want = parallel.replicate_kv_heads(spec, params, 4)  # tiny-llama: 2 KV heads -> 4
    shardings = jax.tree.leaves(parallel.param_shardings(want_spec, mesh))
    loaded = {"orbax": restore_params(tmp_path / "ckpt", mesh=mesh)[:2],
              "hf": import_hf(tmp_path / "hf", name=model, mesh=mesh)}
    for source, (got_spec, got) in loaded.items():
        assert got_spec == want_spec, source
        for x, y, sharding in zip(jax.tree.leaves(got), jax.tree.leaves(want), shardings):
            assert x.sharding.is_equivalent_to(sharding, x.ndim), source
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
