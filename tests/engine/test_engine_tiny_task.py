"""The trained tiny copy model answers through the full engine, even under heavy preemption."""

from pathlib import Path

import numpy as np
import pytest

from experiments.lm.tiny_task import CopyTask, score
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.models.checkpoint import read_metadata

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-copy"


# Slow (about a minute per mode on 2 cores): preemption's exactness is also checked, faster, by the
# seeded batching-independence cases of tests/engine/test_engine_liveness.py (swap, recompute).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_copy_task_accuracy_under_forced_preemption(mode):
    task = CopyTask(**read_metadata(ASSET)["provenance"]["task"])
    examples = task.examples(np.random.default_rng(7), 16, min_source=48)
    config = EngineConfig(
        model=ModelConfig(name="tiny-copy", checkpoint=str(ASSET), attention_backend="xla"),
        # 40 blocks of 16 = 640 slots for 16 requests of up to 256 tokens: preemption is constant.
        cache=CacheConfig(block_size=16, num_blocks=41, num_host_blocks=64, watermark=0.0),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=512,
                                  preemption_mode=mode))
    engine = LLMEngine(config)
    outputs = engine.generate([p for p, _ in examples], SamplingParams(max_tokens=task.answer_len), use_tqdm=False)
    result = score([o.output_token_ids[0] for o in outputs], [a for _, a in examples])
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    assert result["token_accuracy"] >= 0.95, result
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
