"""Test helpers shared across folders: a tiny paged engine, and a dense-cache greedy / beam reference
of the same model (a full forward per token, no KV cache) to compare it against."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from jpaged.config.presets import get_preset
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor
from jpaged.models import decoder

PAD_LEN = 128


def make_engine(model="tiny-opt", block_size=8, num_blocks=64, num_host_blocks=64, preemption_mode="recompute",
                max_num_seqs=16, max_model_len=128, params=None, watermark=0.0, prefix_caching=False,
                num_host_cache_blocks=0, eviction_policy="lru", policy="chunked", speculative=None,
                async_scheduling=False, attention_backend="xla"):
    """A small engine on the real model (XLA attention unless `attention_backend` says), its pool
    and limits set by the arguments (`speculative`: a SpeculativeConfig, None: off)."""
    config = EngineConfig(
        model=ModelConfig(name=model, attention_backend=attention_backend),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                          watermark=watermark, enable_prefix_caching=prefix_caching,
                          num_host_cache_blocks=num_host_cache_blocks, eviction_policy=eviction_policy),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                  max_model_len=max_model_len, preemption_mode=preemption_mode, policy=policy,
                                  async_scheduling=async_scheduling),
        speculative=speculative or SpeculativeConfig())
    return LLMEngine(config, executor=JaxExecutor(config, params=params))


def run_to_end(engine, max_steps=300):
    """Steps `engine` until nothing is unfinished (asserting it gets there within `max_steps`);
    returns the finished outputs by request id."""
    outputs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished()
    return outputs


@functools.lru_cache(maxsize=4)
def dense_logprobs_fn(model):
    """The jitted dense forward of `model`'s seed-0 weights, cached per model name."""
    spec = get_preset(model)
    params = decoder.init_params(spec, seed=0)

    @jax.jit
    def logprobs(tokens):  # i32[B, PAD_LEN] -> f32[B, PAD_LEN, V]
        return jax.nn.log_softmax(decoder.dense_forward(spec, params, tokens), axis=-1)

    return logprobs


def dense_next_logprobs(model, seqs):
    """Log-probabilities of the next token after each sequence, by a full dense forward."""
    tokens = np.zeros((len(seqs), PAD_LEN), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    out = np.asarray(dense_logprobs_fn(model)(jnp.asarray(tokens)))
    return np.stack([out[i, len(s) - 1] for i, s in enumerate(seqs)])


def dense_greedy(model, prompts, max_tokens):
    """Greedy continuation of every prompt, recomputing the whole sequence each token (no cache)."""
    seqs = [list(p) for p in prompts]
    for _ in range(max_tokens):
        nxt = dense_next_logprobs(model, seqs).argmax(-1)
        for s, t in zip(seqs, nxt):
            s.append(int(t))
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def dense_beam_search(model, prompt, width, max_tokens):
    """Textbook beam search on the dense model: keep the `width` best sequences by total logprob."""
    beams = [(0.0, list(prompt))]
    for _ in range(max_tokens):
        lp = dense_next_logprobs(model, [b[1] for b in beams])
        cands = []
        for bi, (score, seq) in enumerate(beams):
            for tok in np.argsort(-lp[bi], kind="stable")[: 2 * width]:
                cands.append((score + float(lp[bi, tok]), bi, seq + [int(tok)]))
        cands.sort(key=lambda c: (-c[0], c[1]))
        beams = [(c[0], c[2]) for c in cands[:width]]
    return [(seq[len(prompt):], score) for score, seq in beams]

