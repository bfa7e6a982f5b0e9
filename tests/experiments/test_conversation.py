"""The conversation experiment: the host tier raises the prefix-hit rate on the simulator and on the
real engine, changes no reply, and bad settings are refused naming the field."""

import json

import pytest

from experiments import conversation
from experiments.conversation import cpu
from experiments.conversation.report import conversation as report_section
from jpaged.config import CacheConfig, SchedulerConfig


def test_simulated_tier_raises_the_hit_rate(tmp_path):
    config = conversation.ConversationConfig(host_tiers=[0.0, 4.0], eviction_policies=["lru"], rates=[2.0],
                                             warmup_s=30.0, duration_s=40.0,
                                             cache=CacheConfig(block_size=16, num_blocks=984),
                                             scheduler=SchedulerConfig(policy="paper", max_model_len=2048,
                                                                       max_num_batched_tokens=2048),
                                             output=str(tmp_path / "c.json"), figure=str(tmp_path / "c.png"))
    result = conversation.run(config)
    without, with_tier = result["points"]
    assert (without["host_cache_blocks"], with_tier["host_cache_blocks"]) == (0, 4 * 983)
    assert without["host_cache_promotions"] == 0 < with_tier["host_cache_promotions"]
    assert with_tier["prefix_hit_rate"] > without["prefix_hit_rate"]
    assert set(result["sustained_rate"]) == {"host 0x lru", "host 4x lru"}
    assert json.loads((tmp_path / "c.json").read_text())["sustained_rate"] == result["sustained_rate"]
    section = report_section({"conversation": result}, lambda *figs: "")
    assert "host 4x lru" in section and "PCIe" in section


def test_real_tier_raises_the_hit_rate_and_changes_no_reply(tmp_path):
    config = cpu.ConversationCPUConfig(model="tiny-llama", host_tiers=[0.0, 4.0], eviction_policies=["lru"],
                                       num_conversations=6, turns=3, query_len=16, reply_len=8, concurrency=2,
                                       cache=CacheConfig(block_size=8, num_blocks=16),
                                       scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256,
                                                                 max_model_len=256),
                                       output=str(tmp_path / "cpu.json"))
    without, with_tier = cpu.run(config)["runs"]
    assert without["host_cache_promotions"] == 0 < with_tier["host_cache_promotions"]
    assert with_tier["prefix_hit_rate"] > without["prefix_hit_rate"]
    assert without["replies_as_without_tier"] and with_tier["replies_as_without_tier"]


@pytest.mark.parametrize("field, value", [("host_tiers", [-1.0]), ("eviction_policies", ["fifo"]), ("rates", [0.0]),
                                          ("duration_s", 0.0)])
def test_bad_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        conversation.ConversationConfig(**{field: value})


@pytest.mark.parametrize("field, value", [("host_tiers", [1.0]), ("eviction_policies", ["mru"]), ("turns", 0)])
def test_bad_cpu_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        cpu.ConversationCPUConfig(**{field: value})
