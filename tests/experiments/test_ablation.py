"""The ablation runner (experiments/ablation): its configs, its field setting, and one small run."""

import json
from pathlib import Path

import pytest

from experiments.ablation import AblationConfig, Variant, figure_config, report, run, set_fields
from experiments.common import REPO_ROOT
from jpaged.config import load_config
from jpaged.config.loading import config_from_dict


def test_set_fields_sets_dotted_fields_and_leaves_the_base_alone():
    base = {"a": 1, "sim": {"cost": {"x": None, "y": 2}}}
    out = set_fields(base, {"a": 3, "sim.cost.x": 0.5})
    assert out == {"a": 3, "sim": {"cost": {"x": 0.5, "y": 2}}}
    assert base == {"a": 1, "sim": {"cost": {"x": None, "y": 2}}}


@pytest.mark.parametrize("dotted, message", [("sim.cost.z", "no field 'z'"), ("a.b", "a is not a section")])
def test_set_fields_names_a_field_the_config_lacks(dotted, message):
    with pytest.raises(ValueError, match=message):
        set_fields({"a": 1, "sim": {"cost": {"x": 1}}}, {dotted: 0})


@pytest.mark.parametrize("data, message", [
    ({"experiment": "fig99"}, "experiment must be one of"),
    ({"name": "Bad Name"}, "name must be"),
    ({"variants": [{"name": "baseline", "set": {"seed": 1}}]}, "not 'baseline'"),
    ({"paper": {"q": [2.0, 1.0]}}, r"paper.q must be \[lo, hi\]"),
    ({"readings": ["guess"]}, "readings must list"),
    ({"variants": [{"name": "v", "set": {}}]}, "must change at least one field"),
    ({"variants": [{"name": "v", "set": {"seed": 1}, "reading": "hunch"}]}, "reading must be"),
    ({"variants": [{"name": "v", "set": {"seed": 1}, "compare_with": "w"}]}, "compare_with must name an earlier row"),
])
def test_config_errors_name_the_field(data, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(AblationConfig, {"experiment": "chatbot", "base": "configs/chatbot.yaml", "name": "x", **data})


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "ablation").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_committed_ablation_builds_each_rows_figure_config(path):
    config = load_config(path, AblationConfig)
    assert config.variants and config.paper
    for variant in config.variants:
        fig = figure_config(config, variant.name, variant.set, variant.systems)  # strict: a typo'd field raises
        assert Path(fig.output).parent == Path(config.output).parent / "ablation" / config.name
        for dotted, value in variant.set.items():
            node = fig
            for part in dotted.split("."):
                node = node[part] if isinstance(node, dict) else getattr(node, part)
            assert node == value, f"{path.name}: {variant.name}: {dotted}"


def test_a_small_chatbot_ablation(tmp_path):
    config = AblationConfig(
        experiment="chatbot", base="configs/chatbot.yaml", name="tiny",
        common={"duration_s": 20.0, "systems": ["vllm", "orca_oracle"],
                "rates": {"vllm": [0.5, 8.0], "orca_oracle": [0.5, 8.0]}},
        variants=[Variant(name="orca at 8 seqs", set={"scheduler.max_num_seqs": 8}, systems=["orca_oracle"]),
                  Variant(name="read at 2x", set={"latency_threshold_factor": 2.0})],
        paper={"vLLM / Orca (Oracle)": [1.8, 2.2]}, output=str(tmp_path / "ablation_tiny.json"))
    result = run(config)
    base, orca_only, reread = result["rows"]
    assert [r["name"] for r in result["rows"]] == ["baseline", "orca at 8 seqs", "read at 2x"]
    assert json.loads((tmp_path / "ablation_tiny.json").read_text())["rows"][2]["name"] == "read at 2x"
    # the Orca-only row reran Orca alone and kept the baseline's vLLM points
    rows_points = json.loads((tmp_path / "ablation" / "tiny" / "orca_at_8_seqs.json").read_text())["points"]
    assert {p["system"] for p in rows_points} == {"orca_oracle"}
    assert orca_only["quantities"]["vLLM sustained (req/s)"] == base["quantities"]["vLLM sustained (req/s)"]
    # the read-only row ran nothing: the baseline's points at another threshold
    assert reread["result"] is None and reread["set"] == {"latency_threshold_factor": 2.0}
    assert set(reread["quantities"]) == set(base["quantities"])
    ratio = base["quantities"]["vLLM / Orca (Oracle)"]
    assert ratio == base["quantities"]["vLLM sustained (req/s)"] / base["quantities"]["Orca (Oracle) sustained (req/s)"]


def test_a_check_row_is_measured_against_its_twin_and_is_no_modelling_choice():
    rows = [{"name": "baseline", "reading": "baseline", "set": {}, "quantities": {"r": 2.0}, "why": ""},
            {"name": "fast", "reading": "bound", "set": {"x": 1}, "quantities": {"r": 3.0}, "why": ""},
            {"name": "fast, long", "reading": "check", "set": {"x": 1, "d": 2}, "quantities": {"r": 3.3}, "why": "",
             "compare_with": "fast"}]
    a = {"rows": rows, "paper": {"r": [2.9, 3.1]}, "columns": []}
    lines = report.table(a, None).splitlines()
    assert "fast, long (change vs fast)" in lines[-1] and "(+10%)" in lines[-1]
    changes, inside, source = report.moves(a, "r")
    assert [name for name, _ in changes] == ["fast"] and inside == ["fast"] and source == []
    assert report.checks(a, "r") == [("fast, long", "fast", 3.3, pytest.approx(0.1))]
