"""Held-out loss and greedy samples of the asset language model (dense forward, no cache).

Used by experiments/lm/train_lm.py on the saved model, reloaded through the project's Hugging Face
importer, so the reported numbers are those of the committed files.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.lm import model


def heldout_loss(spec, params, stream: np.ndarray, seq_len: int, batch_size: int) -> dict[str, float]:
    """Mean next-token loss over `stream` cut into non-overlapping windows of seq_len + 1 tokens.

    Windows overlap by one token, so every token but the first is predicted exactly once, each
    with up to seq_len tokens of context (a fresh context at every window start).
    """
    n = (len(stream) - 1) // seq_len
    if n < 1:
        raise ValueError(f"held-out stream has {len(stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    windows = np.stack([stream[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])  # [n, seq_len + 1]

    @jax.jit
    def row_nll(tokens):  # [B, seq_len + 1] -> summed loss per row [B]
        logits = model.forward(spec, params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).sum(-1)

    total = 0.0
    for start in range(0, n, batch_size):
        chunk = windows[start:start + batch_size]
        # One compiled shape: the last batch is padded with copies whose losses are dropped.
        padded = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - len(chunk), axis=0)])
        total += float(np.asarray(row_nll(jnp.asarray(padded)))[:len(chunk)].sum())
    loss = total / (n * seq_len)
    return {"heldout_tokens": n * seq_len, "heldout_loss": loss, "heldout_perplexity": math.exp(loss)}


def unigram_loss(train: np.ndarray, heldout: np.ndarray, vocab_size: int) -> float:
    """Loss of the train stream's add-one unigram distribution on `heldout` (a context-free baseline)."""
    counts = np.bincount(train, minlength=vocab_size) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout].mean())


def greedy(spec, params, prompts: list[list[int]], max_new_tokens: int, stop_ids: tuple[int, ...],
           seq_len: int) -> list[list[int]]:
    """Greedy continuations of `prompts` (each stops after a token of `stop_ids`).

    All prompts share one [P, seq_len] buffer; causality makes the tokens past each row's position
    irrelevant, so every step is the same compiled forward.
    """
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds seq_len {seq_len}")
    buf = np.zeros((len(prompts), seq_len), np.int32)
    for row, p in enumerate(prompts):
        buf[row, :len(p)] = p
    pos = np.array([len(p) for p in prompts])
    out: list[list[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), bool)
    step = jax.jit(lambda tokens: model.forward(spec, params, tokens))
    for _ in range(max_new_tokens):
        logits = np.asarray(step(jnp.asarray(buf)))  # [P, seq_len, V]
        nxt = logits[np.arange(len(prompts)), pos - 1].argmax(-1)
        for row in np.flatnonzero(~done):
            out[row].append(int(nxt[row]))
            buf[row, pos[row]] = nxt[row]
            done[row] = nxt[row] in stop_ids
        pos += 1
        if done.all():
            break
    return out
