"""Held-out loss, greedy samples and (for a draft model) greedy agreement with a target (dense forward, no cache).

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


def greedy_agreement(spec, params, target_spec, target_params, prompts: list[list[int]], max_new_tokens: int,
                     stop_ids: tuple[int, ...], k: int) -> dict[str, float]:
    """How often a draft model's argmax is the target's greedy token, given the target's prefix.

    The target continues each prompt greedily (up to `max_new_tokens`, through a stop token); the
    draft then reads prompt + continuation in one dense forward (teacher forcing). Under greedy
    verification this is exact, not a model: a drafted token is accepted iff it equals the target's,
    and while drafts are accepted the draft's context is the target's. So the replay of speculative
    decoding with `k` drafted tokens per verify step (accept the longest matching run, then the
    target's own token) gives the tokens each target step yields, measured; the i.i.d. estimate
    (1 - a^(k+1)) / (1 - a) from the agreement rate a is reported beside it.
    """
    longest = max(len(p) for p in prompts)
    continuations = greedy(target_spec, target_params, prompts, max_new_tokens, stop_ids, longest + max_new_tokens)
    buf = np.zeros((len(prompts), longest + max_new_tokens), np.int32)
    for row, (p, c) in enumerate(zip(prompts, continuations)):
        buf[row, :len(p) + len(c)] = p + c
    predicted = np.asarray(jax.jit(lambda t: model.forward(spec, params, t).argmax(-1))(jnp.asarray(buf)))
    hits = [predicted[row, len(p) - 1:len(p) - 1 + len(c)] == np.asarray(c)  # position i predicts c[i]
            for row, (p, c) in enumerate(zip(prompts, continuations))]
    a = float(np.concatenate(hits).mean())
    return {"agreement_positions": sum(len(h) for h in hits), "greedy_agreement": a,
            f"greedy_tokens_per_verify_step_k{k}": tokens_per_verify_step(hits, k),
            f"iid_tokens_per_verify_step_k{k}": (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0}


def tokens_per_verify_step(hits: list[np.ndarray], k: int) -> float:
    """Greedy speculative decoding replayed on per-position draft hits: tokens per target step.

    Each verify step accepts the run of hits from the current position (at most k) and adds the
    target's own next token; a sequence's last step may yield fewer where the sequence ends.
    """
    steps = 0
    for hit in hits:
        i = 0
        while i < len(hit):
            run = 0
            while run < k and i + run < len(hit) and hit[i + run]:
                run += 1
            i += run + 1
            steps += 1
    return sum(len(h) for h in hits) / steps
