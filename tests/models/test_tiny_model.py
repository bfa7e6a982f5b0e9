"""The committed tiny copy-task model answers through a correct paged cache, and fails on a corrupt one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from experiments.lm.tiny_task import SEP, CopyTask, score
from experiments.paged_batch import greedy_generate, scattered_tables
from jpaged.models.checkpoint import restore_params
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner

ASSET = Path(__file__).resolve().parents[2] / "assets" / "tiny-copy"
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_copy():
    spec, params, meta = restore_params(ASSET)
    return spec, params, CopyTask(**meta["provenance"]["task"])


def generate(spec, params, task, n, *, corrupt):
    """Greedy answers of n examples; `corrupt` makes decode read each table rotated by one block."""
    rng = np.random.default_rng(123)
    examples = task.examples(rng, n, min_source=48)  # prompts of 50..240 tokens, >= 4 blocks each
    need = [-(-(len(p) + task.answer_len) // BLOCK_SIZE) for p, _ in examples]
    num_blocks = sum(need) + 8
    tables = scattered_tables(rng, need, num_blocks)
    decode_tables = [t[1:] + t[:1] for t in tables] if corrupt else None
    runner = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla")
    pool = init_kv_pool(spec, num_blocks, BLOCK_SIZE)
    generated, _ = greedy_generate(runner, pool, [p for p, _ in examples], task.answer_len, tables,
                                   decode_tables=decode_tables)
    return score(generated, [a for _, a in examples])


def test_correct_paged_cache_answers(tiny_copy):
    result = generate(*tiny_copy, 24, corrupt=False)
    assert result["token_accuracy"] >= 0.95 and result["exact_match"] >= 0.9, result


def test_corrupted_paged_cache_fails(tiny_copy):
    result = generate(*tiny_copy, 24, corrupt=True)
    assert result["token_accuracy"] < 0.5, result


def test_task_examples_and_score():
    task = CopyTask(vocab_size=64, min_source=8, max_source=20, answer_len=4)
    for prompt, answer in task.examples(np.random.default_rng(0), 20):
        length = prompt.index(SEP, 1) - 1
        src = prompt[1:length + 1]
        copied = prompt[length + 2:]
        assert len(set(src)) == length and src[:len(copied)] == copied
        assert answer == src[len(copied):len(copied) + 4]
    tokens, mask = task.train_batch(np.random.default_rng(0), 3)
    assert tokens.shape == mask.shape == (3, 42)
    assert score([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]]) == {"token_accuracy": 5 / 6, "exact_match": 0.5}
    with pytest.raises(ValueError, match="answer_len"):
        CopyTask(min_source=4, answer_len=8)
