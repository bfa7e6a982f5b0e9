"""Trains the asset language model on the Python standard library and saves it as a HF directory.

    python -m experiments.lm.train_lm --config configs/train_lm.yaml

One command, no download: the stdlib's source files (experiments/lm/corpus.py) train a byte-level
BPE (experiments/lm/tokenizer.py), then a small LLaMA (RMSNorm, RoPE, SwiGLU, GQA, tied
embeddings; jpaged's own decoder, experiments/lm/model.py) with optax AdamW on random windows of
the token stream. The output directory is what `transformers.LlamaForCausalLM.from_pretrained`,
`jpaged.models.checkpoint.import_hf` and `jpaged.text.tokenizer.Tokenizer.from_dir` read: config.json,
generation_config.json, model.safetensors, tokenizer.json, tokenizer_config.json (with a ChatML
chat template), plus train_summary.json (held-out loss, samples, timing, provenance). The reported
numbers are measured on the saved files, reloaded through `import_hf`.

The same command trains a draft model for speculative decoding (configs/train_lm_draft.yaml):
`tokenizer_from` reuses another model's tokenizer files instead of training a BPE, and
`distill_from` names the model it drafts for, whose logits can join the loss and whose greedy
continuations it is measured against (top-1 agreement, tokens per verify step).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import save_file
from tqdm import tqdm

from experiments import common
from experiments.lm import corpus, evaluate, model, tokenizer
from jpaged.config import load_config
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.llm import LLM
from jpaged.models.checkpoint import import_hf
from jpaged.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# What a model shares with the one whose tokenizer it reuses: ids, special tokens, chat template, stops.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclasses.dataclass(frozen=True)
class TrainLMConfig:
    """Corpus, tokenizer, architecture and optimisation of the asset language model."""

    corpus_glob: str = "*.py"  # files of the stdlib directory (sysconfig's "stdlib" path) to train on
    holdout_every: int = 20  # every k-th corpus file (sorted) is held out for evaluation
    chat_max_chars: int = 1500  # longest function source turned into a chat example
    vocab_size: int = 4096  # BPE vocabulary including the 5 special tokens
    hidden_size: int = 192  # residual width
    num_layers: int = 4  # decoder blocks
    num_heads: int = 6  # query heads (head_dim = hidden_size / num_heads)
    num_kv_heads: int = 2  # key/value heads (GQA)
    intermediate_size: int = 512  # SwiGLU width
    seq_len: int = 512  # window of the last long_steps steps; also max_position_embeddings
    short_seq_len: int = 256  # window of the steps before (attention cost grows with the window)
    long_steps: int = 100  # final steps at seq_len, with the same tokens per step (fewer windows)
    rope_theta: float = 10000.0  # RoPE base
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    seed: int = 0  # initialisation, document order and training windows
    steps: int = 800  # optimizer steps
    batch_size: int = 16  # short windows per step (tokens per step: batch_size * short_seq_len)
    learning_rate: float = 3e-3  # peak AdamW learning rate (linear warmup, cosine decay to 10%)
    warmup_steps: int = 60  # warmup steps
    weight_decay: float = 0.01  # AdamW weight decay
    dtype: str = "bfloat16"  # dtype of the saved weights (float32 or bfloat16); training is float32
    sample_prompts: tuple[str, ...] = ("import os\n", "class Stack:\n    def __init__(self):\n")  # greedy samples
    sample_chat: tuple[str, ...] = ("Write a Python function `is_even(n)`. Return True if n is even.",)  # user turns
    sample_tokens: int = 64  # tokens per greedy sample
    output: str = "assets/stdlib-lm"  # Hugging Face directory written (replaced)
    tokenizer_from: str = ""  # HF directory whose tokenizer files are copied instead of training a BPE ("": train)
    distill_from: str = ""  # HF directory of the model this one drafts for (same tokenizer files); "": none
    # Loss = (1 - w) * cross-entropy on the data + w * KL(target || model) on the same windows. A
    # draft is worth what it agrees with the target, not with the data: the soft labels carry the
    # target's ranking of every token (its argmax is the one verification accepts greedily).
    distill_weight: float = 0.0
    agreement_prompts: int = 64  # held-out prompts the greedy agreement with distill_from is measured on
    agreement_prompt_tokens: int = 64  # tokens per such prompt (a window of the held-out stream)
    agreement_tokens: int = 64  # target greedy tokens per prompt that the model must predict
    speculative_k: int = 4  # drafted tokens per verify step in the reported tokens per step
    # Self-distillation: the target's own greedy continuations join the training windows. A draft
    # is used where the target generates, and a small target's greedy text (repetitive, often a
    # loop) is far from the corpus it trained on; EAGLE and Medusa-2 train on the target's outputs
    # for the same reason. Half the prompts are training-stream windows, half uniformly random
    # token ids (the prompts of vLLM's random dataset); continuations ignore EOS, as those
    # benchmarks run. The agreement is then also measured on random prompts of another seed.
    target_sequences: int = 0  # prompts the target continues (0: train on the corpus alone)
    target_prompt_tokens: int = 64  # tokens per such prompt
    target_tokens: int = 128  # greedy tokens the target adds to each
    target_window_share: float = 0.5  # share of each step's windows cut from the continuations

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "short_seq_len", "sample_tokens", "chat_max_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.long_steps <= self.steps:
            raise ValueError(f"long_steps: must be in [0, steps={self.steps}], got {self.long_steps}")
        if self.short_seq_len > self.seq_len or (self.batch_size * self.short_seq_len) % self.seq_len:
            raise ValueError(f"short_seq_len: must be <= seq_len ({self.seq_len}) with batch_size * short_seq_len "
                             f"a multiple of seq_len, got {self.short_seq_len}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps: must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight: must be in [0, 1], got {self.distill_weight}")
        if self.distill_weight > 0 and not self.distill_from:
            raise ValueError("distill_weight: > 0 needs distill_from (the model whose logits are the soft labels)")
        for name in ("agreement_prompts", "agreement_prompt_tokens", "agreement_tokens", "speculative_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.target_sequences < 0 or min(self.target_prompt_tokens, self.target_tokens) < 1:
            raise ValueError("target_sequences: must be >= 0, target_prompt_tokens and target_tokens >= 1")
        if self.target_sequences and not self.distill_from:
            raise ValueError("target_sequences: > 0 needs distill_from (the model whose continuations are trained on)")
        if not 0.0 <= self.target_window_share < 1.0:
            raise ValueError(f"target_window_share: must be in [0, 1), got {self.target_window_share}")
        if self.distill_from and self.agreement_prompt_tokens + self.agreement_tokens > self.seq_len:
            raise ValueError(f"agreement_prompt_tokens + agreement_tokens: must be <= seq_len ({self.seq_len}), "
                             f"got {self.agreement_prompt_tokens + self.agreement_tokens}")


def _streams(tok: Tokenizer, train_docs: list[str], held_docs: list[str], seed: int) -> tuple[np.ndarray, ...]:
    """Token streams: documents in a seeded order, each BOS + text + EOS (chat texts carry their BOS)."""
    def encode(docs):
        order = np.random.default_rng(seed).permutation(len(docs))
        ids = tok.encode_batch([docs[i] for i in order], add_special_tokens=False)
        return np.concatenate([(x if x[:1] == [tok.bos_token_id] else [tok.bos_token_id] + x) + [tok.eos_token_id]
                               for x in ids]).astype(np.int32)
    return encode(train_docs), encode(held_docs)


def _documents(config: TrainLMConfig, tok: Tokenizer, texts: list[str]) -> tuple[list[str], int]:
    """Files plus their chat examples rendered with the model's own chat template; (docs, number of chats)."""
    chats = [tok.apply_chat_template(m) for t in texts for m in corpus.chat_examples(t, config.chat_max_chars)]
    return texts + chats, len(chats)


def train(config: TrainLMConfig, spec, stream: np.ndarray, teacher: tuple | None = None,
          generated: np.ndarray | None = None) -> tuple[dict, list[float], float]:
    """AdamW over random windows of `stream`; (params, per-step cross-entropy losses, CPU seconds).

    With `teacher` = (spec, params) and `config.distill_weight` > 0, the loss mixes in the KL
    divergence from the teacher's next-token distribution on the same windows. With `generated`
    (the teacher's continuations, one stream), `config.target_window_share` of each step's
    windows are cut from it instead.
    """
    params = model.init_params(spec, config.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                                  config.steps, config.learning_rate * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=config.weight_decay))
    opt_state = optimizer.init(params)

    w = config.distill_weight if teacher is not None else 0.0
    teacher_spec, teacher_params = teacher if w > 0 else (None, None)

    def loss_fn(params, teacher_params, tokens):  # tokens [B, seq_len + 1]: position t predicts t + 1
        logits = model.forward(spec, params, tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        if not w:
            return ce, ce
        target = jax.nn.log_softmax(model.forward(teacher_spec, teacher_params, tokens[:, :-1]))
        kl = (jnp.exp(target) * (target - jax.nn.log_softmax(logits))).sum(-1).mean()
        return (1 - w) * ce + w * kl, ce

    # The teacher's weights are an argument, not a constant folded into the compiled step.
    @functools.partial(jax.jit, donate_argnums=(0, 1))  # update the parameters and moments in place
    def step(params, opt_state, teacher_params, tokens):
        (_, ce), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, teacher_params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ce

    rng = np.random.default_rng(config.seed + 1)
    losses, cpu0 = [], time.process_time()
    bar = tqdm(range(config.steps), desc="train stdlib-lm", mininterval=5.0)
    for i in bar:
        length = config.seq_len if i >= config.steps - config.long_steps else config.short_seq_len
        windows = config.batch_size * config.short_seq_len // length
        own = round(windows * config.target_window_share) if generated is not None else 0
        rows = [stream[s:s + length + 1] for s in rng.integers(0, len(stream) - length - 1, windows - own)]
        if own:  # (no draw otherwise: a corpus-only run takes the windows it always took)
            rows += [generated[s:s + length + 1] for s in rng.integers(0, len(generated) - length - 1, own)]
        batch = np.stack(rows)  # [windows, length + 1]
        params, opt_state, loss = step(params, opt_state, teacher_params, jnp.asarray(batch))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return params, losses, time.process_time() - cpu0


def _hf_config(config: TrainLMConfig, tok: Tokenizer) -> dict:
    return model.hf_config(vocab_size=tok.vocab_size, hidden_size=config.hidden_size,
                              num_layers=config.num_layers, num_heads=config.num_heads,
                              num_kv_heads=config.num_kv_heads, intermediate_size=config.intermediate_size,
                              max_position_embeddings=config.seq_len, rms_norm_eps=config.rms_norm_eps,
                              rope_theta=config.rope_theta, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype=config.dtype)


def _save_model(directory: Path, hf: dict, tok: Tokenizer, spec, params) -> None:
    """config.json, generation_config.json (stops at EOS and at the end of an assistant turn), weights.

    A generation_config.json already in `directory` (copied with a shared tokenizer) is kept.
    """
    (directory / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    if not (directory / "generation_config.json").exists():
        generation = {"bos_token_id": tok.bos_token_id,
                      "eos_token_id": [tok.eos_token_id, tok.token_to_id(tokenizer.IM_END)],
                      "pad_token_id": tok.pad_token_id}
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(model.hf_tensors(spec, params, hf["torch_dtype"]), str(directory / "model.safetensors"),
              metadata={"format": "pt"})


def _copy_tokenizer(source: Path, directory: Path) -> None:
    """Copies `source`'s tokenizer and generation files, so both models map text to the same ids and stop alike."""
    directory.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if not (source / name).is_file():
            raise ValueError(f"tokenizer_from: {source} has no {name}")
        shutil.copyfile(source / name, directory / name)


def _load_teacher(config: TrainLMConfig, directory: Path) -> tuple:
    """(spec, float32 params) of `distill_from`, refused unless its tokenizer.json equals the one in `directory`."""
    source = Path(config.distill_from)
    if (source / "tokenizer.json").read_bytes() != (directory / "tokenizer.json").read_bytes():
        raise ValueError(f"distill_from: {source}/tokenizer.json differs from this model's tokenizer "
                         "(set tokenizer_from to it)")
    return import_hf(source, name=source.name)


def _target_continuations(config: TrainLMConfig, stream: np.ndarray, vocab_size: int) -> np.ndarray:
    """`distill_from`'s greedy continuations (self-distillation data), served by jpaged's engine.

    Half the `target_sequences` prompts are random windows of the training stream, half uniformly
    random token ids; returns one stream of each prompt followed by its continuation.
    """
    rng = np.random.default_rng(config.seed + 2)
    n, length = config.target_sequences, config.target_prompt_tokens
    prompts = [stream[s:s + length].tolist() for s in rng.integers(0, len(stream) - length, n // 2)]
    prompts += rng.integers(0, vocab_size, (n - n // 2, length)).tolist()
    # 256 sequences at once, each with its blocks for prompt + continuation (block 0 is reserved).
    llm = LLM(config.distill_from, warmup=False, dtype="float32", block_size=32, max_num_seqs=256,
              num_blocks=256 * -(-(length + config.target_tokens) // 32) + 1,
              max_model_len=length + config.target_tokens)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=config.target_tokens, ignore_eos=True))
    return np.concatenate([p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs)]).astype(np.int32)


def _agreement(config: TrainLMConfig, spec, params, teacher: tuple, stream: np.ndarray,
               stop_ids: tuple[int, ...], vocab_size: int) -> dict:
    """Greedy agreement with `distill_from` on evenly spaced windows of the held-out stream and,
    prefixed `random_`, on prompts of uniformly random token ids (a seed no training prompt used)."""
    n, length = config.agreement_prompts, config.agreement_prompt_tokens
    starts = np.linspace(0, len(stream) - length, n).astype(int)
    prompts = [stream[s:s + length].tolist() for s in starts]
    random_prompts = np.random.default_rng(config.seed + 3).integers(0, vocab_size, (n, length)).tolist()
    context = config.seq_len // 2  # a mid-window token: its attention cost is counted too
    flops = model.flops_per_token(spec, context), model.flops_per_token(teacher[0], context)
    on_random = evaluate.greedy_agreement(spec, params, *teacher, random_prompts, config.agreement_tokens, (),
                                          config.speculative_k)  # no stop: as the random benchmarks run
    return {"flops_per_token": flops[0], "target_flops_per_token": flops[1], "flops_context": context,
            "target_over_draft_flops": flops[1] / flops[0],
            **evaluate.greedy_agreement(spec, params, *teacher, prompts, config.agreement_tokens, stop_ids,
                                        config.speculative_k),
            **{f"random_{key}": value for key, value in on_random.items()}}


def run(config: TrainLMConfig) -> dict:
    """Corpus -> tokenizer -> model -> saved HF directory -> evaluation of the saved files; the summary."""
    wall0, load0 = time.perf_counter(), os.getloadavg()
    provenance = common.provenance(config, seed=config.seed)  # the code as it is when training starts
    files = corpus.corpus_files(config.corpus_glob)
    texts = corpus.read_texts(files)
    train_texts, held_texts = corpus.split(texts, config.holdout_every)
    out = Path(config.output)
    staging = out.with_name(out.name + ".partial")  # replaced atomically at the end
    shutil.rmtree(staging, ignore_errors=True)
    if config.tokenizer_from:
        _copy_tokenizer(Path(config.tokenizer_from), staging)
    else:
        tokenizer.save_tokenizer(tokenizer.train_tokenizer(train_texts, config.vocab_size), staging, config.seq_len)
    tok = Tokenizer.from_dir(staging)
    if config.tokenizer_from and tok.vocab_size != config.vocab_size:
        raise ValueError(f"vocab_size: {config.vocab_size}, but the tokenizer of {config.tokenizer_from} has "
                         f"{tok.vocab_size} ids")
    teacher = _load_teacher(config, staging) if config.distill_from else None
    train_docs, train_chats = _documents(config, tok, train_texts)
    held_docs, held_chats = _documents(config, tok, held_texts)
    train_stream, held_stream = _streams(tok, train_docs, held_docs, config.seed)
    log.info("corpus: %d train docs (%d chats), %d tokens; %d held-out docs, %d tokens", len(train_docs),
             train_chats, len(train_stream), len(held_docs), len(held_stream))

    hf = _hf_config(config, tok)
    spec = model.spec_of(hf, out.name)
    continuations = _target_continuations(config, train_stream, tok.vocab_size) if config.target_sequences else None
    params, losses, cpu_seconds = train(config, spec, train_stream, teacher, continuations)
    _save_model(staging, hf, tok, spec, params)

    # Evaluate exactly what was written: weights through the importer, tokenizer with its stop ids.
    spec, saved = import_hf(staging, name=out.name)
    tok = Tokenizer.from_dir(staging)
    metrics = evaluate.heldout_loss(spec, saved, held_stream, config.seq_len, config.batch_size)
    metrics["heldout_bytes_per_token"] = sum(len(d.encode()) for d in held_docs) / len(held_stream)
    metrics["heldout_bits_per_byte"] = metrics["heldout_loss"] / np.log(2) / metrics["heldout_bytes_per_token"]
    metrics["unigram_baseline_loss"] = evaluate.unigram_loss(train_stream, held_stream, tok.vocab_size)
    prompts = [tok.encode(p) for p in config.sample_prompts]
    prompts += [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True)
                for c in config.sample_chat]
    generated = evaluate.greedy(spec, saved, prompts, config.sample_tokens, tok.eos_token_ids, config.seq_len)
    samples = [{"prompt": tok.decode(p, skip_special_tokens=False), "greedy": tok.decode(g, skip_special_tokens=False)}
               for p, g in zip(prompts, generated)]
    if teacher is not None:
        metrics |= _agreement(config, spec, saved, teacher, held_stream, tok.eos_token_ids, tok.vocab_size)
    summary = {
        "num_params": model.param_count(params), "train_tokens_per_epoch": int(len(train_stream)),
        "train_chat_examples": train_chats, "target_continuation_tokens": 0 if continuations is None else len(continuations),
        "tokens_seen": config.steps * config.batch_size * config.short_seq_len,
        "final_train_loss": float(np.mean(losses[-50:])), **metrics,
        "train_cpu_seconds": round(cpu_seconds, 1), "wall_seconds": round(time.perf_counter() - wall0, 1),
        "load_average_start": [round(x, 2) for x in load0], "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }
    provenance |= {"corpus_dir": str(corpus.stdlib_dir()), "corpus_files": len(files),
                   "corpus_sha256": corpus.corpus_digest(files, texts)}
    record = {"summary": summary, "samples": samples, "loss_curve": [round(x, 4) for x in losses[::10]],
              "provenance": provenance}
    (staging / "train_summary.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return {**summary, "samples": samples}


def main() -> None:
    """CLI: parse --config, train, print the summary block and the samples."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file of TrainLMConfig fields")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    summary = run(load_config(args.config, TrainLMConfig))
    samples = summary.pop("samples")
    for key, value in summary.items():
        print(f"{key:28s} {value}")
    for s in samples:
        print(f"--- prompt {s['prompt']!r}\n{s['greedy']}")


if __name__ == "__main__":
    main()
