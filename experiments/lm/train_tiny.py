"""Trains the tiny copy-task model on CPU and saves it with orbax (assets/tiny-copy).

    python -m experiments.lm.train_tiny --config configs/train_tiny.yaml

The task (experiments.lm.tiny_task) can only be solved by attending ~L tokens back, so the trained
model is a sharp end-to-end check of the paged KV cache: evaluation here already runs greedy
generation through the paged ModelRunner with block tables scattered over the pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from experiments.lm.tiny_task import CopyTask, score
from experiments.paged_batch import greedy_generate, scattered_tables
from jpaged.config import config_to_dict, load_config
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.checkpoint import save_params
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainTinyConfig:
    """Training of the tiny copy-task model."""

    model: str = "tiny-copy"  # preset (jpaged.config.presets) to train
    seed: int = 0  # seeds initialisation, training batches and evaluation examples
    steps: int = 1500  # optimizer steps
    batch_size: int = 16  # sequences per step
    learning_rate: float = 3e-3  # peak AdamW learning rate (warmup, then cosine decay to 10%)
    warmup_steps: int = 100  # linear warmup steps
    weight_decay: float = 0.01  # AdamW weight decay
    min_source: int = 16  # shortest source sequence L of the copy task
    max_source: int = 128  # longest source sequence L
    curriculum_steps: int = 0  # steps over which the longest sampled L grows from 4 x min_source to max_source
    answer_len: int = 16  # generated tokens per evaluation example
    eval_examples: int = 64  # examples generated greedily through the paged runner after training
    block_size: int = 16  # KV block size of the evaluation
    output: str = "assets/tiny-copy"  # orbax checkpoint directory (replaced)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_examples", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.curriculum_steps <= self.steps:
            raise ValueError(f"curriculum_steps: must be in [0, steps={self.steps}], got {self.curriculum_steps}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps: must be in [0, steps={self.steps}), got {self.warmup_steps}")

    @property
    def task(self) -> CopyTask:
        """The copy task these settings describe."""
        return CopyTask(vocab_size=get_preset(self.model).vocab_size, min_source=self.min_source,
                        max_source=self.max_source, answer_len=self.answer_len)


def evaluate(spec, params, task: CopyTask, n: int, block_size: int, seed: int) -> dict[str, float]:
    """Greedy answers of `n` task examples through the paged runner (scattered blocks), scored."""
    rng = np.random.default_rng(seed)
    examples = task.examples(rng, n)
    need = [-(-(len(p) + task.answer_len) // block_size) for p, _ in examples]
    num_blocks = sum(need) + 1
    tables = scattered_tables(rng, need, num_blocks)
    runner = ModelRunner(spec, params, block_size=block_size, attention_backend="xla")
    pool = init_kv_pool(spec, num_blocks, block_size)
    generated, _ = greedy_generate(runner, pool, [p for p, _ in examples], task.answer_len, tables)
    return score(generated, [a for _, a in examples])


def _curriculum_max_source(config: TrainTinyConfig, step: int) -> int:
    """Longest source length sampled at `step`, rounded up to a multiple of 16 (a few shapes to compile).

    Short sources first: the induction mechanism forms sooner among fewer distractors, and RoPE's
    relative positions carry it over to longer sources.
    """
    start = min(4 * config.min_source, config.max_source)
    frac = min(1.0, step / config.curriculum_steps) if config.curriculum_steps else 1.0
    length = start + frac * (config.max_source - start)
    return min(config.max_source, -(-int(length) // 16) * 16)


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(config: TrainTinyConfig) -> dict:
    """Trains, evaluates through the paged cache, saves the checkpoint; returns the summary."""
    spec, task = get_preset(config.model), config.task
    params = decoder.init_params(spec, config.seed)
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps,
                                                  config.steps, config.learning_rate * 0.1)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=config.weight_decay))
    opt_state = optimizer.init(params)

    def loss_fn(params, tokens, mask):
        # tokens, mask [B, L]: position t predicts tokens[t + 1] where mask[t] == 1.
        logits = decoder.dense_forward(spec, params, tokens)[:, :-1]  # [B, L-1, V]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        m = mask[:, :-1]
        correct = (logits.argmax(-1) == tokens[:, 1:]) * m
        return (nll * m).sum() / m.sum(), correct.sum() / m.sum()

    @jax.jit
    def train_step(params, opt_state, tokens, mask):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    rng = np.random.default_rng(config.seed)
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc="train tiny-copy", mininterval=2.0)
    for step in bar:
        tokens, mask = task.train_batch(rng, config.batch_size, _curriculum_max_source(config, step))
        params, opt_state, loss, acc = train_step(params, opt_state, jnp.asarray(tokens), jnp.asarray(mask))
        bar.set_postfix(loss=f"{float(loss):.3f}", acc=f"{float(acc):.3f}", refresh=False)
    train_seconds = time.perf_counter() - start
    metrics = evaluate(spec, params, task, config.eval_examples, config.block_size, config.seed + 1)
    summary = {"final_loss": float(loss), "final_train_token_accuracy": float(acc),
               "train_seconds": round(train_seconds, 1), **metrics}
    provenance = {"git_sha": _git_sha(), "jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "config": config_to_dict(config), "task": dataclasses.asdict(task)}
    save_params(config.output, spec, params, metadata={"summary": summary, "provenance": provenance})
    return summary


def main() -> None:
    """CLI: parse --config, train, print the summary block."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file of TrainTinyConfig fields")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    summary = run(load_config(args.config, TrainTinyConfig))
    for key, value in summary.items():
        print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()
