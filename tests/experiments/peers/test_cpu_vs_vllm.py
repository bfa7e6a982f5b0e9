"""experiments.peers.cpu_vs_vllm without vLLM: the HF directory it writes, jpaged's side, the skip message."""

import jax
import numpy as np
import pytest

from experiments.peers import cpu_vs_vllm
from experiments.peers.cpu_peer_vllm import tree_cpu_seconds
from experiments.peers.cpu_vs_vllm import CpuVsVllmConfig
from jpaged.models import decoder
from jpaged.models.checkpoint import import_hf


def test_hf_dir_holds_the_dummy_weights(tmp_path):
    directory = cpu_vs_vllm.write_hf_dir(tmp_path / "m", "tiny-opt", seed=3)
    spec, params = import_hf(directory, name="tiny-opt")
    expected = decoder.init_params(spec, 3)
    for a, b in zip(*(map(np.asarray, jax.tree.leaves(t)) for t in (params, expected))):
        np.testing.assert_array_equal(a, b)


def test_jpaged_side_runs_and_the_vllm_side_is_skipped_without_vllm(tmp_path, capsys):
    config = CpuVsVllmConfig(model="tiny-opt", num_requests=3, max_model_len=64, max_num_seqs=4,
                             max_num_batched_tokens=256, kv_slots=[64], rounds=2, length_scale=0.05,
                             vllm_python=str(tmp_path / "no-python"), output=str(tmp_path / "r.json"))
    result = cpu_vs_vllm.run(config)
    assert "vLLM side skipped" in capsys.readouterr().out
    assert result["vllm_skipped"] and len(result["conditions"]) == 1
    condition = result["conditions"][0]
    assert set(condition["runs"]) == {"jpaged"} and len(condition["runs"]["jpaged"]) == 2
    assert condition["summary"]["jpaged"]["tok_per_cpu_s"] > 0 and condition["summary"]["jpaged_deterministic"]


def test_tree_cpu_seconds_counts_this_process():
    before = tree_cpu_seconds()
    sum(i * i for i in range(2_000_000))
    assert tree_cpu_seconds() > before


@pytest.mark.parametrize("field, value", [("dtypes", ["float16"]), ("kv_slots", [100]), ("rounds", 0),
                                          ("kv_slots", [32])])
def test_bad_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        CpuVsVllmConfig(**{field: value})


def test_logprobs_close_is_vllm_s_test_of_the_first_difference():
    close = cpu_vs_vllm.logprobs_close
    top = [[[5, -0.1], [6, -0.2]], [[7, -0.1], [8, -0.3]], [[9, -0.1], [1, -0.2]]]  # per position
    assert close([5, 7, 9], top, [5, 7, 9], top)
    # They part at position 1; each token is among the other's candidates there; later ones are not compared.
    assert close([5, 7, 9], top, [5, 8, 3], [top[0], [[8, -0.1], [7, -0.2]], [[3, -0.1]]])
    assert not close([5, 7, 9], top, [5, 4, 9], [top[0], [[4, -0.1], [7, -0.2]], top[2]])  # 4 not among a's
    assert not close([5, 7, 9], top, [5, 8, 9], [top[0], [[8, -0.1], [2, -0.2]], top[2]])  # 7 not among b's
    assert not close([5, 7], top, [5, 7, 9], top)  # a prefix is not the same output
