"""The committed asset model (assets/stdlib-lm): loads through the project's HF import, equals
transformers' LlamaForCausalLM on the same files, predicts Python far better than chance, and
serves through the paged engine. Never trains: `python -m experiments.lm.train_lm` made the asset.
"""

from __future__ import annotations

import json
import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.lm.evaluate import greedy
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.models.checkpoint import import_hf, load_params
from jpaged.models.decoder import dense_forward
from jpaged.text.tokenizer import Tokenizer
from tests.helpers.text_assets import ASSET, SNIPPET


@pytest.fixture(scope="module")
def model():
    spec, params = import_hf(ASSET, name="stdlib-lm")
    return spec, params, Tokenizer.from_dir(ASSET)


def test_files_and_spec(model):
    spec, params, tok = model
    config = json.loads((ASSET / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (spec.family, spec.vocab_size, spec.num_heads, spec.num_kv_heads) == ("llama", 4096, 6, 2)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    assert spec.max_position_embeddings == config["max_position_embeddings"] == 512
    size = sum(f.stat().st_size for f in ASSET.iterdir())
    assert size < 8 * 2**20, f"asset is {size / 2**20:.1f} MiB"


def test_engine_config_loads_the_same_weights(model):
    spec, params, _ = model
    spec2, params2 = load_params(ModelConfig(name="stdlib-lm", checkpoint=str(ASSET)))
    assert spec2 == spec
    assert np.array_equal(params2["layers"]["q"]["kernel"], params["layers"]["q"]["kernel"])


def test_predicts_unseen_python_far_better_than_chance(model):
    spec, params, tok = model
    ids = jnp.asarray([tok.encode(SNIPPET)], jnp.int32)
    logits = dense_forward(spec, params, ids[:, :-1])
    loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean())
    top1 = float((logits.argmax(-1) == ids[:, 1:]).mean())
    # Uniform guessing: ln 4096 = 8.3 nats; the committed model: 2.27 nats, 52% top-1 on this snippet.
    assert loss < 3.0 < math.log(tok.vocab_size) and top1 > 0.4, (loss, top1)


def test_greedy_through_the_paged_engine_equals_dense(model):
    spec, params, tok = model
    prompts = [tok.encode("import os\n"), tok.encode("class Stack:\n    def __init__(self):\n"),
               tok.apply_chat_template([{"role": "user", "content": "Write a Python function `add(a, b)`."}],
                                       add_generation_prompt=True, tokenize=True)]
    config = EngineConfig(model=ModelConfig(name="stdlib-lm", checkpoint=str(ASSET), attention_backend="xla"),
                          cache=CacheConfig(block_size=16, num_blocks=64, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512))
    engine = LLMEngine(config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=False)
    dense = greedy(spec, params, prompts, 24, stop_ids=(), seq_len=128)
    assert [o.output_token_ids[0] for o in outs] == dense
