"""Prompt rows of a decode-shaped step (a one-token prompt chunk beside decodes) and of a step with
a longer chunk are scored by the model step's own program: they equal a dense forward of the
model, and after the warm-up they compile nothing."""

import jax.numpy as jnp
import numpy as np

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors import warmup
from jpaged.executors.jax import JaxExecutor
from tests.helpers.tiny_engines import PAD_LEN, dense_logprobs_fn, run_to_end

MODEL = "tiny-opt"


def test_prompt_rows_of_decode_shaped_steps_match_dense_without_compiling(monkeypatch):
    # A budget of 4 tokens: while three requests decode, the fourth's prompt goes one token a step;
    # once they end, four tokens a step.
    config = EngineConfig(model=ModelConfig(name=MODEL, attention_backend="xla"),
                          cache=CacheConfig(block_size=8, num_blocks=64, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64,
                                                    policy="chunked"))
    engine = LLMEngine(config, executor=JaxExecutor(config))
    warmup.compile_grid(engine.executor, config, progress=False)
    warm = engine.kv_stats()["num_compilations"]
    step_kinds = []  # max_query_len of each step with prompt rows
    run = JaxExecutor._run_model

    def spy(self, plan):
        if plan.prompt_rows is not None:
            step_kinds.append(plan.max_query_len)
        return run(self, plan)

    monkeypatch.setattr(JaxExecutor, "_run_model", spy)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 3, 3, 20)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=6 if i < 3 else 2, ignore_eos=True,
                                                          prompt_logprobs=None if i < 3 else 3))
    output = run_to_end(engine)["3"]
    assert 1 in step_kinds and max(step_kinds) > 1  # decode-shaped steps and a longer chunk both score rows
    assert engine.kv_stats()["num_compilations"] == warm
    prompt = prompts[3]
    tokens = np.zeros((1, PAD_LEN), np.int32)
    tokens[0, : len(prompt)] = prompt
    dense = np.asarray(dense_logprobs_fn(MODEL)(jnp.asarray(tokens)))[0]  # [PAD_LEN, V]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for t in range(1, len(prompt)):
        entry, row = output.prompt_logprobs[t], dense[t - 1]
        top = np.argsort(-row, kind="stable")[:3].tolist()
        assert set(entry) == {prompt[t], *top}
        for token, logprob in entry.items():
            np.testing.assert_allclose(logprob, row[token], atol=2e-5)
        assert output.prompt_ranks[t] == int((row >= row[prompt[t]]).sum())
