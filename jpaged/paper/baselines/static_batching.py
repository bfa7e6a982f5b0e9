"""Static batching over a contiguous KV cache: the Hugging Face `generate` way, as a real baseline.

Requests are taken in arrival order, `batch_size` at a time. A batch is left-padded to its longest
prompt, prefilled at once, then decoded one token per step for every row until its longest request
is done; rows that finished early keep computing padding. The KV cache is one contiguous
`[L, B, max_len, Hkv, D]` array per batch, reserved up front for the longest possible sequence.
Same model, same weights and same greedy decoding as the paged engine, so the comparison isolates
memory management and scheduling.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.config.presets import ModelSpec
from jpaged.core.padding import bucket
from jpaged.models import decoder, layers


def _masked_attention(q, k, v, key_valid, scale):
    """q [B, Lq, Hq, D], k/v [B, Lk, Hkv, D], key_valid bool[B, Lq, Lk] -> [B, Lq, Hq, D]."""
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, lq, hkv, hq // hkv, d)
    scores = jnp.einsum("blhgd,bmhd->bhglm", qg, k, preferred_element_type=jnp.float32) * scale
    # A finite mask value: padding query rows see no valid key, and must stay finite (their K/V
    # feed the next layer, where 0 * NaN would leak into real rows).
    scores = jnp.where(key_valid[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhglm,bmhd->blhgd", probs, v).reshape(b, lq, hq, d)


class StaticBatchGenerator:
    """Greedy generation for fixed batches over a contiguous cache; counts compilations."""

    def __init__(self, spec: ModelSpec, params: decoder.Params, dtype=jnp.float32):
        self.spec = spec
        self.params = params
        self.dtype = dtype
        self.num_compilations = 0
        self._step = jax.jit(self._forward, donate_argnums=(1,))

    def _forward(self, params, cache, tokens, positions, start, key_valid):
        """tokens/positions i32[B, Lq] written at columns [start, start + Lq) -> (last logits [B, V], cache)."""
        self.num_compilations += 1
        spec = self.spec
        scale = layers.softmax_scale(spec)

        def attend(cache, i, q, k, v):
            k_cache, v_cache = cache  # [L, B, Lmax, Hkv, D]
            # Write the new columns straight into the stacked cache (in place, like the paged
            # pool), then read the layer back for attention.
            where = (i, 0, start, 0, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), where)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), where)
            out = _masked_attention(q, k_cache[i], v_cache[i], key_valid, scale)
            return out, (k_cache, v_cache)

        model = decoder.merge(spec, params)
        h, cache = model.run_layers(model.embed_tokens(tokens, positions), positions, cache, attend)
        return model.logits(h[:, -1]), cache

    def generate_batch(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        """Greedy outputs of one batch; every row runs until the batch's longest request ends."""
        spec = self.spec
        n = len(prompts)
        rows = bucket(n, minimum=1)
        prompt_len = bucket(max(map(len, prompts)), minimum=8)
        steps = max(max_tokens)
        max_len = prompt_len + bucket(steps, minimum=8)
        if max_len > spec.max_position_embeddings:
            raise ValueError(f"prompt + output of {max_len} tokens exceeds the model's "
                             f"max_position_embeddings={spec.max_position_embeddings}")
        tokens = np.zeros((rows, prompt_len), np.int32)
        pad = np.full(rows, prompt_len, np.int32)  # left padding per row (padded rows: all padding)
        for i, p in enumerate(prompts):
            tokens[i, prompt_len - len(p):] = p
            pad[i] = prompt_len - len(p)
        columns = np.arange(max_len)
        shape = (spec.num_layers, rows, max_len, spec.num_kv_heads, spec.head_dim)
        cache = (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
        # Prefill: query column c sees key columns in [pad, c].
        query_cols = np.arange(prompt_len)
        valid = (columns[None, None, :] >= pad[:, None, None]) & (columns[None, None, :] <= query_cols[None, :, None])
        positions = np.maximum(query_cols[None, :] - pad[:, None], 0).astype(np.int32)
        logits, cache = self._step(self.params, cache, jnp.asarray(tokens), jnp.asarray(positions), 0,
                                   jnp.asarray(valid))
        outputs = [[] for _ in range(n)]
        for t in range(steps):
            next_tokens = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
            for i in range(n):
                if len(outputs[i]) < max_tokens[i]:
                    outputs[i].append(int(next_tokens[i]))
            if t == steps - 1:
                break
            col = prompt_len + t
            valid = (columns[None, None, :] >= pad[:, None, None]) & (columns[None, None, :] <= col)
            positions = (col - pad)[:, None].astype(np.int32)
            logits, cache = self._step(self.params, cache, jnp.asarray(next_tokens[:, None]), jnp.asarray(positions),
                                       col, jnp.asarray(valid))
        return outputs

    def generate(self, prompts: list[list[int]], max_tokens: list[int], batch_size: int
                 ) -> tuple[list[list[int]], float]:
        """All requests in arrival order, `batch_size` per batch; returns outputs and wall seconds."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        start = time.perf_counter()
        outputs: list[list[int]] = []
        for lo in range(0, len(prompts), batch_size):
            outputs += self.generate_batch(prompts[lo:lo + batch_size], max_tokens[lo:lo + batch_size])
        return outputs, time.perf_counter() - start
