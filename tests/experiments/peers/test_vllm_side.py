"""Where the vLLM peer's interpreter comes from: a config field, else $JPAGED_VLLM_PYTHON, never a
committed path; without one the reason says how to give it."""

import sys

from experiments.peers import vllm_side


def test_the_config_field_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("JPAGED_VLLM_PYTHON", "/from/env")
    assert vllm_side.vllm_python("/from/config") == "/from/config"
    assert vllm_side.vllm_python("") == "/from/env"


def test_no_interpreter_names_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.delenv("JPAGED_VLLM_PYTHON", raising=False)
    assert "JPAGED_VLLM_PYTHON" in vllm_side.vllm_unavailable(vllm_side.vllm_python(""))
    assert "does not exist" in vllm_side.vllm_unavailable(str(tmp_path / "python"))
    assert "cannot import vllm" in vllm_side.vllm_unavailable(sys.executable)  # (the test venv has no vllm)


def test_no_committed_config_names_a_machine_s_interpreter():
    from pathlib import Path
    configs = Path(__file__).resolve().parents[3] / "configs"
    assert not [p.name for p in configs.glob("*.yaml") if "vllm_python" in p.read_text()]
