"""Where the vLLM peer's interpreter comes from: a config field, else $JPAGED_VLLM_PYTHON, never a
committed path; without one the reason says how to give it."""

import sys

from experiments import vllm_side


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
    configs = Path(__file__).resolve().parents[2] / "configs"
    assert list(configs.glob("*.yaml"))
    assert not [p.name for p in configs.glob("*.yaml") if "vllm_python" in p.read_text()]


def test_server_command_gives_vllm_the_same_kv_slots_and_limits():
    command = vllm_side.server_command("/vllm/python", "assets/stdlib-lm", 8200, dtype="float32", block_size=32,
                                       kv_slots=4096 * 32, max_num_seqs=256, max_num_batched_tokens=2048,
                                       max_model_len=512)
    flags = dict(zip(command[3::2], command[4::2]))
    assert command[:3] == ["/vllm/python", "-m", "vllm.entrypoints.openai.api_server"]
    # 131,072 slots x (K and V x 4 layers x 2 KV heads x 32 dims x 4 bytes)
    assert flags["--kv-cache-memory-bytes"] == str(131072 * 2048) and flags["--block-size"] == "32"
    assert (flags["--max-num-seqs"], flags["--max-num-batched-tokens"], flags["--max-model-len"]) == ("256", "2048", "512")
    assert "--no-enable-prefix-caching" in command


def test_random_dataset_args_send_a_temperature_only_when_given():
    args = vllm_side.random_dataset_args("assets/stdlib-lm", input_len=128, output_len=64, num_prompts=10,
                                         rate=float("inf"), seed=3, temperature=None)
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--dataset-name"] == "random" and flags["--random-output-len"] == "64" and "--ignore-eos" in args
    assert "--temperature" not in args  # the client's default (1.0), as vLLM's benchmark sends it
    greedy = vllm_side.random_dataset_args("m", input_len=1, output_len=1, num_prompts=1, rate=4.0, seed=0,
                                           temperature=0.0)
    assert greedy[-2:] == ["--temperature", "0.0"] and greedy[greedy.index("--request-rate") + 1] == "4.0"
