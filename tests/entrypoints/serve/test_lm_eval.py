"""lm-evaluation-harness's `local-completions` against a real `jpaged serve`: a log-likelihood
(multiple_choice) task and a generate_until task, both written here (JSONL + task YAML, read with
`--include_path`), nothing downloaded. The harness's numbers must equal what jpaged's offline LLM
says about the same data: accuracy from its prompt log-probabilities, exact match from its greedy text.

Skips without lm_eval (the `lmeval` extra: it pulls datasets, pandas, pyarrow, scikit-learn).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "lm_eval", "transformers"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install -e \".[test,lmeval]\"")

from experiments.peers.echo_vs_vllm import MC_YAML
from jpaged import LLM, SamplingParams
from tests.helpers.server import MODEL, REPO, running_server
from tests.helpers.text_assets import ASSET

pytestmark = pytest.mark.slow

# (context, choices, index of the target): the continuation is the choice exactly (target_delimiter "").
# The last item's target is a choice the model finds unlikely, so the accuracy is not trivially 1.
MC_DOCS = [
    ("def __init__(self", ["):", " cat dog", "]]]"], 0),
    ("import o", ["s\n", "xyz", "!!"], 0),
    ("if __name__ == '__main__", ["':\n", "'?", "\"\n\n\n"], 0),
    ("for i in range(", ["10):\n", "}}}", " ]) ("], 0),
    ("    def __repr__(self):\n        return", [" f'", "(((", " ++"], 0),
    ("class Foo(", ["object):", "$$$"], 1),
]
GEN_PROMPTS = ["def add(a, b):\n    return", "import", "class Stack:\n    def", "for line in"]
MAX_GEN = 8

GEN_YAML = """task: jpaged_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _expected_accuracy(llm: LLM, tokenizer) -> float:
    """The multiple-choice accuracy by jpaged's own prompt log-probabilities, tokenized as lm-eval
    does (context alone, then context + choice; no BOS)."""
    correct = 0
    for context, choices, target in MC_DOCS:
        context_ids = tokenizer.encode(context, add_special_tokens=False)
        scores = []
        for choice in choices:
            whole = tokenizer.encode(context + choice, add_special_tokens=False)
            out = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            scores.append(sum(out.prompt_logprobs[t][whole[t]] for t in range(len(context_ids), len(whole))))
        correct += max(range(len(choices)), key=scores.__getitem__) == target
    return correct / len(MC_DOCS)


def _run_harness(server, tasks_dir, tasks: list[str], out_dir) -> dict:
    """lm-eval's CLI against `server` on `tasks`: their results by task name."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(out_dir / "hf-datasets")}
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
            (f"model={MODEL},base_url={server.base_url}/v1/completions,tokenizer={ASSET},"
             f"tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"),
            "--batch_size", "4", "--tasks", ",".join(tasks), "--include_path", str(tasks_dir),
            "--output_path", str(out_dir / "results")]
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = sorted((out_dir / "results").rglob("results_*.json"))
    return json.loads(results[-1].read_text())["results"]


def test_lm_eval_local_completions_loglikelihood_and_generate(tmp_path):
    from transformers import AutoTokenizer

    llm = LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla")
    tokenizer = AutoTokenizer.from_pretrained(str(ASSET))
    expected_acc = _expected_accuracy(llm, tokenizer)
    # Targets: the offline greedy text (of the prompt tokenized as lm-eval does: no BOS) up to the
    # first newline, and one deliberately wrong.
    greedy = [o.outputs[0].text for o in llm.generate(
        [tokenizer.encode(p, add_special_tokens=False) for p in GEN_PROMPTS],
        SamplingParams(max_tokens=MAX_GEN, temperature=0, stop=["\n"]), use_tqdm=False)]
    targets = greedy[:-1] + [greedy[-1] + " (not what the model says)"]
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    (tasks_dir / "mc.jsonl").write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n"
                                                for c, ch, a in MC_DOCS))
    (tasks_dir / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n"
                                                 for p, t in zip(GEN_PROMPTS, targets)))
    (tasks_dir / "mc.yaml").write_text(MC_YAML.format(task="jpaged_mc", data=tasks_dir / "mc.jsonl"))
    (tasks_dir / "gen.yaml").write_text(GEN_YAML.format(data=tasks_dir / "gen.jsonl", max_gen=MAX_GEN))
    with running_server(tmp_path) as server:
        results = _run_harness(server, tasks_dir, ["jpaged_mc", "jpaged_gen"], tmp_path)
    mc, gen = results["jpaged_mc"], results["jpaged_gen"]
    assert 0 < expected_acc < 1
    assert mc["acc,none"] == pytest.approx(expected_acc)
    assert gen["exact_match,none"] == pytest.approx((len(GEN_PROMPTS) - 1) / len(GEN_PROMPTS))
