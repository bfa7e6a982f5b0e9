"""Request traces: ShareGPT- and Alpaca-shaped lengths, local dataset import, Poisson arrivals.

The paper's datasets cannot be downloaded here, so lengths come from distributions whose shapes
were measured on real samples and whose locations match the paper's means (161.31 / 337.99 tokens
for ShareGPT, 19.31 / 58.45 for Alpaca, after the vLLM filter). Every shape parameter below is
quoted from ../shared/WORKLOADS.md ("Fitted shapes" and "Recommended generators"); the two that were
calibrated here are marked CALIBRATED. Input and output lengths are drawn independently (measured
log correlation +0.10 ShareGPT, -0.21 Alpaca) and pairs failing the filter are redrawn.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Callable, Literal

import numpy as np

# vLLM's benchmark filter (benchmarks/benchmark_serving.py sample_requests): drop a pair if the
# prompt or output is shorter than 4 tokens, the prompt is longer than 1024, or the two exceed 2048.
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# The paper's means (§6.1, OPT tokenizer, after the filter): the calibration targets.
PAPER_MEANS = {"sharegpt": (161.31, 337.99), "alpaca": (19.31, 58.45)}

# ShareGPT human first turn: w LogNormal(mu, sigma) + (1 - w) bounded Pareto(alpha, L, U)
# [WORKLOADS.md, KS 0.016].
SG_HUMAN_W, SG_HUMAN_MU, SG_HUMAN_SIGMA = 0.1914, 2.2181, 0.3621
SG_PARETO_ALPHA, SG_PARETO_L, SG_PARETO_U = 0.3831, 12.0, 1024.0
# ShareGPT reply: Weibull(k, lambda) [WORKLOADS.md, KS 0.036]; k as measured (lambda 356.97 there).
SG_REPLY_K = 1.3514
# CALIBRATED by `calibrate_sharegpt(n=1_000_000, seed=0, rounds=4)` (~20 s): the prompt is a
# human-turn draw with probability p, else a reply draw (vLLM's sampler ignores roles, so chunks of
# the split ShareGPT file that start with a ChatGPT turn put a reply in the prompt; WORKLOADS.md
# estimates p ~ 0.77 by resampling the measured CSV), and the reply Weibull scale lambda (used for
# outputs and reply-prompts alike; 356.97 measured). Solved jointly so that the filtered means are
# the paper's 161.31 / 337.99 (check: 161.54 / 338.04 on 1M samples of another seed).
SG_PROMPT_P_HUMAN = 0.7486
SG_REPLY_LAMBDA = 368.19

# Alpaca: prompt LogNormal, output two-lognormal mixture; the recommended generator of
# WORKLOADS.md, already located to give 19.28 / 58.40 after the filter (not recalibrated here).
AL_PROMPT_MU, AL_PROMPT_SIGMA = 2.8391, 0.4900
AL_OUT_W, AL_OUT_MU1, AL_OUT_SIGMA1, AL_OUT_MU2, AL_OUT_SIGMA2 = 0.384, 2.4377, 0.5676, 4.2934, 0.5645

Dataset = Literal["sharegpt", "alpaca"]


def _check_dataset(dataset: str) -> None:
    if dataset not in PAPER_MEANS:
        raise ValueError(f"dataset must be 'sharegpt' or 'alpaca', got {dataset!r}")


def _human_turns(m: int, rng: np.random.Generator) -> np.ndarray:
    """m float lengths of ShareGPT human turns (the lognormal + bounded Pareto mixture)."""
    lognormal = np.exp(rng.normal(SG_HUMAN_MU, SG_HUMAN_SIGMA, m))
    a, lo, hi = SG_PARETO_ALPHA, SG_PARETO_L, SG_PARETO_U
    # Inverse CDF of the Pareto(alpha) truncated to [L, U].
    pareto = lo / (1.0 - rng.random(m) * (1.0 - (lo / hi) ** a)) ** (1.0 / a)
    return np.where(rng.random(m) < SG_HUMAN_W, lognormal, pareto)


def _sharegpt_candidates(m: int, rng: np.random.Generator, p_human: float,
                         reply_lambda: float) -> tuple[np.ndarray, np.ndarray]:
    """m unfiltered (prompt, output) float draws of the ShareGPT generator."""
    human = _human_turns(m, rng)
    reply_prompt = reply_lambda * rng.weibull(SG_REPLY_K, m)
    prompt = np.where(rng.random(m) < p_human, human, reply_prompt)
    output = reply_lambda * rng.weibull(SG_REPLY_K, m)
    return prompt, output


def _alpaca_candidates(m: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """m unfiltered (prompt, output) float draws of the Alpaca generator."""
    prompt = np.exp(rng.normal(AL_PROMPT_MU, AL_PROMPT_SIGMA, m))
    short = np.exp(rng.normal(AL_OUT_MU1, AL_OUT_SIGMA1, m))
    main = np.exp(rng.normal(AL_OUT_MU2, AL_OUT_SIGMA2, m))
    return prompt, np.where(rng.random(m) < AL_OUT_W, short, main)


def passes_filter(prompt_lens: np.ndarray, output_lens: np.ndarray) -> np.ndarray:
    """bool[n]: which (prompt, output) length pairs survive vLLM's benchmark filter."""
    return ((prompt_lens >= MIN_LEN) & (output_lens >= MIN_LEN) & (prompt_lens <= MAX_PROMPT_LEN)
            & (prompt_lens + output_lens <= MAX_TOTAL_LEN))


def sample_lengths(dataset: Dataset, n: int, rng: np.random.Generator, *,
                   p_human: float = SG_PROMPT_P_HUMAN,
                   reply_lambda: float = SG_REPLY_LAMBDA) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt_len, output_len) pairs (int64[n] each) that pass the vLLM filter.

    Lengths are drawn independently, rounded to the nearest token, and rejected pairs are redrawn
    in vectorized batches. `p_human` and `reply_lambda` exist for calibration (ShareGPT only).
    """
    _check_dataset(dataset)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    prompts, outputs, have = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], 0
    while have < n:
        # Over-draw by ~25% so that one batch nearly always suffices (acceptance is ~80-99%).
        m = int((n - have) * 1.25) + 64
        if dataset == "sharegpt":
            p, o = _sharegpt_candidates(m, rng, p_human, reply_lambda)
        else:
            p, o = _alpaca_candidates(m, rng)
        p, o = np.rint(p).astype(np.int64), np.rint(o).astype(np.int64)
        keep = passes_filter(p, o)
        prompts.append(p[keep])
        outputs.append(o[keep])
        have += int(keep.sum())
    return np.concatenate(prompts)[:n], np.concatenate(outputs)[:n]


def calibrate_sharegpt(n: int = 1_000_000, seed: int = 0, rounds: int = 4) -> tuple[float, float]:
    """(p_human, reply_lambda) whose filtered ShareGPT means hit the paper's 161.31 / 337.99.

    Alternates two bisections (p for the input mean, lambda for the output mean) on common random
    numbers: the same seed for every evaluation, so the objective is smooth in each parameter.
    """
    target_in, target_out = PAPER_MEANS["sharegpt"]

    def means(p: float, lam: float) -> tuple[float, float]:
        ins, outs = sample_lengths("sharegpt", n, np.random.default_rng(seed), p_human=p, reply_lambda=lam)
        return float(ins.mean()), float(outs.mean())

    def bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
        # f is monotone on [lo, hi] and changes sign there; 20 halvings reach ~1e-6 of the range.
        f_lo = f(lo)
        for _ in range(20):
            mid = 0.5 * (lo + hi)
            f_mid = f(mid)
            if (f_mid > 0) == (f_lo > 0):
                lo, f_lo = mid, f_mid
            else:
                hi = mid
        return 0.5 * (lo + hi)

    p, lam = 0.77, 357.0
    for _ in range(rounds):
        p = bisect(lambda x: means(x, lam)[0] - target_in, 0.3, 1.0)
        lam = bisect(lambda x: means(p, x)[1] - target_out, 250.0, 500.0)
    return p, lam


def poisson_arrivals(rate: float, rng: np.random.Generator, *, num_requests: int | None = None,
                     duration_s: float | None = None) -> np.ndarray:
    """float64[n] arrival times (s) of a Poisson process at `rate` requests/s, starting at 0.

    The trace ends at `duration_s` or after `num_requests`, whichever comes first (at least one must
    be given). `rate = inf` sends every request at time 0 (needs `num_requests`).
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s (inf allowed), got {rate}")
    if num_requests is None and duration_s is None:
        raise ValueError("num_requests or duration_s must be given")
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if duration_s is not None and not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if math.isinf(rate):
        if num_requests is None:
            raise ValueError("rate=inf needs num_requests (every request arrives at t=0)")
        return np.zeros(num_requests)
    if duration_s is None:
        return np.cumsum(rng.exponential(1.0 / rate, num_requests))
    times, last = [], 0.0
    while last < duration_s and (num_requests is None or sum(map(len, times)) < num_requests):
        # One chunk covers the duration with overwhelming probability (mean + 6 sigma).
        expected = rate * (duration_s - last)
        chunk = last + np.cumsum(rng.exponential(1.0 / rate, int(expected + 6 * math.sqrt(expected)) + 16))
        times.append(chunk)
        last = float(chunk[-1])
    arrivals = np.concatenate(times)
    arrivals = arrivals[arrivals < duration_s]
    return arrivals if num_requests is None else arrivals[:num_requests]


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """A request trace: dataset shape, Poisson rate, length of the trace, seed."""

    dataset: Dataset = "sharegpt"  # length distribution (or the format of dataset_path)
    request_rate: float = 1.0  # Poisson arrival rate in requests/s; .inf sends all at t=0
    duration_s: float | None = 3600.0  # trace length in seconds (paper: 1 h; 15 min for OPT-175B); null = none
    num_requests: int | None = None  # cap on the number of requests; null = as many as arrive in duration_s
    seed: int = 0  # seeds arrivals, lengths and synthetic prompt token ids
    dataset_path: str | None = None  # local ShareGPT/Alpaca JSON; null = generated lengths (nothing is downloaded)
    tokenizer_path: str | None = None  # local Hugging Face tokenizer dir, needed with dataset_path

    def __post_init__(self) -> None:
        _check_dataset(self.dataset)
        if not self.request_rate > 0:
            raise ValueError(f"workload.request_rate must be > 0 (inf allowed), got {self.request_rate}")
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("workload.duration_s or workload.num_requests must be set")
        if self.duration_s is not None and not (0 < self.duration_s < math.inf):
            raise ValueError(f"workload.duration_s must be finite and > 0, got {self.duration_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"workload.num_requests must be >= 1, got {self.num_requests}")
        if math.isinf(self.request_rate) and self.num_requests is None:
            raise ValueError("workload.request_rate=inf needs workload.num_requests")
        if (self.dataset_path is None) != (self.tokenizer_path is None):
            raise ValueError("workload.dataset_path and workload.tokenizer_path must be set together")


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    request_id: int  # 0..n-1 in arrival order
    arrival_time: float  # seconds from the start of the trace
    prompt_len: int  # prompt tokens (== len(prompt_token_ids))
    output_len: int  # tokens to generate (max_tokens; EOS is ignored)
    prompt_token_ids: np.ndarray  # i32[prompt_len] real ids (dataset) or seeded pseudo-random ids


def generate_trace(config: WorkloadConfig, vocab_size: int = 50272) -> list[TraceRequest]:
    """The trace `config` describes; deterministic for `config.seed`.

    Synthetic prompts get pseudo-random ids in [4, vocab_size) (above OPT's special tokens), so
    that unrelated prompts never share a prefix by accident.
    """
    if vocab_size < 5:
        raise ValueError(f"vocab_size must be >= 5, got {vocab_size}")
    arrival_rng, length_rng, token_rng = (np.random.default_rng(s)
                                          for s in np.random.SeedSequence(config.seed).spawn(3))
    arrivals = poisson_arrivals(config.request_rate, arrival_rng, num_requests=config.num_requests,
                                duration_s=config.duration_s)
    n = len(arrivals)
    if config.dataset_path is None:
        prompt_lens, output_lens = sample_lengths(config.dataset, n, length_rng)
        flat = token_rng.integers(4, vocab_size, int(prompt_lens.sum()), dtype=np.int32)
        prompts = np.split(flat, np.cumsum(prompt_lens)[:-1]) if n else []
    else:
        pool = load_dataset(config.dataset, config.dataset_path, load_hf_tokenizer(config.tokenizer_path))
        picks = length_rng.choice(len(pool), n, replace=n > len(pool))
        prompts = [np.asarray(pool[i][0], dtype=np.int32) for i in picks]
        output_lens = np.array([pool[i][1] for i in picks], dtype=np.int64)
    return [TraceRequest(i, float(arrivals[i]), len(prompts[i]), int(output_lens[i]), prompts[i])
            for i in range(n)]


def load_dataset(dataset: Dataset, path: str | Path,
                 tokenize: Callable[[str], list[int]]) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) of every pair in a local dataset file that passes the filter.

    ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first two turns of
    each conversation with at least two, whatever their roles, as vLLM's benchmark sampler does.
    Alpaca JSON (a list of {"instruction", "input", "output"}): prompt = instruction, plus "\\n" +
    input when there is one; output = the output text. `tokenize` is applied to both sides.
    """
    _check_dataset(dataset)
    with Path(path).open() as f:
        records = json.load(f)
    if dataset == "sharegpt":
        pairs = [(r["conversations"][0]["value"], r["conversations"][1]["value"])
                 for r in records if len(r.get("conversations", ())) >= 2]
    else:
        pairs = [(r["instruction"] + ("\n" + r["input"] if r.get("input") else ""), r["output"])
                 for r in records]
    pool = []
    for prompt, output in pairs:
        ids, out_len = list(tokenize(prompt)), len(tokenize(output))
        if passes_filter(np.array([len(ids)]), np.array([out_len]))[0]:
            pool.append((ids, out_len))
    if not pool:
        raise ValueError(f"dataset_path {path}: no {dataset} pair passes the length filter")
    return pool


def load_hf_tokenizer(path: str | Path) -> Callable[[str], list[int]]:
    """`tokenize(text) -> ids` from a local Hugging Face tokenizer directory (never downloads)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ImportError("tokenizer_path needs the optional `transformers` package "
                          "(pip install transformers); or pass your own tokenize callable "
                          "to jpaged.paper.workloads.load_dataset") from exc
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return lambda text: tokenizer(text).input_ids


def conversation_lengths(n: int, rng: np.random.Generator, *, mean_rounds: float = 4.0,
                         max_prompt_len: int = 1024, max_output_len: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_len, output_len) int64[n] of chatbot requests (paper §6.5), one per conversation round.

    Conversations are synthesized from the ShareGPT shapes: a Geometric number of rounds with mean
    `mean_rounds` (an assumption: the measured samples hold first turns only); each round a human
    query (the human-turn mixture) and a reply (the calibrated reply Weibull). A round's prompt is
    the whole history (earlier queries and replies) plus its query, cut to the last
    `max_prompt_len` tokens; its output is the reply, capped at `max_output_len`; both at least
    MIN_LEN. Requests are the rounds in conversation order.
    """
    if n < 0 or mean_rounds < 1 or max_prompt_len < MIN_LEN or max_output_len < MIN_LEN:
        raise ValueError(f"need n >= 0, mean_rounds >= 1, max_prompt_len and max_output_len >= {MIN_LEN}; "
                         f"got {n}, {mean_rounds}, {max_prompt_len}, {max_output_len}")
    prompts, outputs = [], []
    while len(prompts) < n:
        rounds = int(rng.geometric(1.0 / mean_rounds))
        queries = np.maximum(np.rint(_human_turns(rounds, rng)), MIN_LEN).astype(np.int64)
        replies = np.maximum(np.rint(SG_REPLY_LAMBDA * rng.weibull(SG_REPLY_K, rounds)), MIN_LEN).astype(np.int64)
        history = np.concatenate([[0], np.cumsum(queries + replies)[:-1]])  # tokens before each round
        prompts.extend(np.minimum(history + queries, max_prompt_len).tolist())
        outputs.extend(np.minimum(replies, max_output_len).tolist())
    return np.array(prompts[:n], dtype=np.int64), np.array(outputs[:n], dtype=np.int64)


def lengths_trace(arrivals: np.ndarray, prompt_lens: np.ndarray, output_lens: np.ndarray,
                  rng: np.random.Generator, vocab_size: int = 50272,
                  prefix: np.ndarray | None = None) -> list[TraceRequest]:
    """Requests at `arrivals` with seeded pseudo-random prompt ids in [4, vocab_size).

    With `prefix` (i32 token ids), every prompt is that prefix followed by prompt_len random
    tokens (so prompt_len counts only the part after the prefix).
    """
    if not len(arrivals) == len(prompt_lens) == len(output_lens):
        raise ValueError(f"arrivals, prompt_lens and output_lens must have one length, got "
                         f"{len(arrivals)}, {len(prompt_lens)}, {len(output_lens)}")
    head = np.zeros(0, np.int32) if prefix is None else np.asarray(prefix, np.int32)
    out = []
    for i, (t, p, o) in enumerate(zip(arrivals.tolist(), prompt_lens.tolist(), output_lens.tolist())):
        ids = np.concatenate([head, rng.integers(4, vocab_size, p, dtype=np.int32)])
        out.append(TraceRequest(i, float(t), len(ids), int(o), ids))
    return out


@dataclasses.dataclass(frozen=True)
class Session:
    """One user's requests in order: a multi-turn conversation, or a single request (one turn).

    Turn 0's prompt is `queries[0]`; turn k's prompt is turn k - 1's prompt, the reply it received,
    then `queries[k]`, so every turn's prompt starts with the whole conversation so far. Turn k + 1
    arrives `think_s[k]` seconds after turn k's reply ended (a closed loop: whoever serves the
    session builds the next prompt from the reply it produced).
    """

    session_id: int  # 0..n-1 in order of start
    start_time: float  # arrival of turn 0, seconds from the start of the trace
    queries: tuple[np.ndarray, ...]  # i32 new tokens of each turn
    output_lens: tuple[int, ...]  # reply tokens of each turn (max_tokens; EOS ignored)
    think_s: tuple[float, ...]  # seconds from turn k's reply to turn k + 1's query; one per later turn


def prefix_pool_sessions(request_rate: float, duration_s: float, seed: int, *, num_prefixes: int,
                         prefix_len: int, zipf_s: float, input_median: float, input_sigma: float,
                         output_median: float, output_sigma: float, vocab_size: int = 50272) -> list[Session]:
    """One-turn sessions at Poisson times: a shared prefix (one of `num_prefixes`) + a task input.

    A service with many few-shot templates or system prompts: prefix j (`prefix_len` seeded tokens,
    the same at every rate) is picked with probability proportional to (j + 1)^-zipf_s (0: uniform);
    the task input and the output are LogNormal(median, sigma) tokens, at least MIN_LEN each.
    """
    if num_prefixes < 1 or prefix_len < 1 or not zipf_s >= 0:
        raise ValueError(f"need num_prefixes >= 1, prefix_len >= 1 and zipf_s >= 0; got {num_prefixes}, "
                         f"{prefix_len}, {zipf_s}")
    prefix_rng, arrival_rng, pick_rng, length_rng, token_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5))
    prefixes = prefix_rng.integers(4, vocab_size, (num_prefixes, prefix_len), dtype=np.int32)
    arrivals = poisson_arrivals(request_rate, arrival_rng, duration_s=duration_s)
    n = len(arrivals)
    weights = np.arange(1, num_prefixes + 1, dtype=np.float64) ** -zipf_s
    picks = pick_rng.choice(num_prefixes, n, p=weights / weights.sum())
    inputs = np.maximum(np.rint(np.exp(length_rng.normal(np.log(input_median), input_sigma, n))), MIN_LEN)
    outputs = np.maximum(np.rint(np.exp(length_rng.normal(np.log(output_median), output_sigma, n))), MIN_LEN)
    return [Session(i, float(arrivals[i]),
                    (np.concatenate([prefixes[picks[i]], token_rng.integers(4, vocab_size, int(inputs[i]), dtype=np.int32)]),),
                    (int(outputs[i]),), ()) for i in range(n)]


def _conversation_shapes(n: int, rng: np.random.Generator, mean_turns: float, think_mean_s: float,
                         max_model_len: int, max_output_len: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(query lengths, reply lengths, think times) of n conversations; see `conversation_sessions`."""
    turns = rng.geometric(1.0 / mean_turns, n)
    total = int(turns.sum())
    queries = np.maximum(np.rint(_human_turns(total, rng)), MIN_LEN).astype(np.int64)
    replies = np.clip(np.rint(SG_REPLY_LAMBDA * rng.weibull(SG_REPLY_K, total)), MIN_LEN, max_output_len).astype(np.int64)
    thinks = rng.exponential(think_mean_s, total)
    shapes, start = [], 0
    for count in turns.tolist():
        q, r = queries[start:start + count].tolist(), replies[start:start + count].tolist()
        context = np.cumsum(np.add(q, r))  # tokens the conversation holds after each turn
        keep = max(1, int(np.searchsorted(context, max_model_len, side="right")))
        q[0] = min(q[0], max_model_len - r[0])  # a first turn alone too long: its query is cut
        shapes.append((q[:keep], r[:keep], thinks[start:start + keep - 1].tolist()))
        start += count
    return shapes


def conversation_sessions(request_rate: float, duration_s: float, seed: int, *, mean_turns: float,
                          think_mean_s: float, max_model_len: int, max_output_len: int,
                          vocab_size: int = 50272) -> list[Session]:
    """Multi-turn chat sessions from the ShareGPT shapes, offering `request_rate` turns/s on average.

    A session has a Geometric number of turns with mean `mean_turns` (an assumption, as in
    `conversation_lengths`); each turn a human query (the human-turn mixture) and a reply (the
    calibrated reply Weibull, at most `max_output_len`); the user thinks Exponential(`think_mean_s`)
    seconds after each reply. History is never cut, so every prompt extends the previous one: a
    session ends before the turn whose context would pass `max_model_len`. Sessions start as a
    Poisson process at `request_rate` / the mean kept turns of 4096 pilot sessions.
    """
    if not mean_turns >= 1 or not think_mean_s >= 0 or not MIN_LEN <= max_output_len < max_model_len - MIN_LEN:
        raise ValueError(f"need mean_turns >= 1, think_mean_s >= 0 and {MIN_LEN} <= max_output_len < "
                         f"max_model_len - {MIN_LEN}; got {mean_turns}, {think_mean_s}, {max_output_len}, {max_model_len}")
    pilot_rng, arrival_rng, shape_rng, token_rng = (np.random.default_rng(s)
                                                    for s in np.random.SeedSequence(seed).spawn(4))
    args = (mean_turns, think_mean_s, max_model_len, max_output_len)
    turns_per_session = np.mean([len(q) for q, _, _ in _conversation_shapes(4096, pilot_rng, *args)])
    arrivals = poisson_arrivals(request_rate / turns_per_session, arrival_rng, duration_s=duration_s)
    return [Session(i, float(t), tuple(token_rng.integers(4, vocab_size, n, dtype=np.int32) for n in q), tuple(r),
                    tuple(think))
            for i, (t, (q, r, think)) in enumerate(zip(arrivals.tolist(),
                                                       _conversation_shapes(len(arrivals), shape_rng, *args)))]
