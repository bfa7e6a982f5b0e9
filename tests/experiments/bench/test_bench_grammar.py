"""experiments.bench.bench_grammar: every case has its timings, the walk stays inside each grammar,
and bad configs name the field."""

import json

import pytest

from experiments.bench import bench_grammar
from tests.helpers.text_assets import ASSET


def test_rows_carry_timings_and_provenance(tmp_path, monkeypatch):
    config = bench_grammar.BenchGrammarConfig(model=str(ASSET), batch_sizes=(1, 3), steps=4, rounds=2, output="out.json",
                                              specs={"regex": {"regex": "[a-z]{1,3}_[0-9]"},
                                                     "choice": {"choice": ["yes", "no"]}})
    monkeypatch.setattr(bench_grammar, "REPO_ROOT", tmp_path)
    result = bench_grammar.run(config)
    assert [(r["spec"], r["rows"]) for r in result["results"]] == [("regex", 1), ("regex", 3), ("choice", 1),
                                                                    ("choice", 3)]
    for row in result["results"]:
        assert row["mask_wall_ms"] > 0 and row["accept_cpu_ms"] >= 0 and row["sampler_wall_ms"] > 0
        assert row["plain_sampler_wall_ms"] > 0 and row["compile_ms"] > 0
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["results"] == result["results"] and "cpu" in saved["provenance"]


@pytest.mark.parametrize("field, value", [("batch_sizes", ()), ("batch_sizes", (0,)), ("steps", 0), ("rounds", 0),
                                          ("specs", {}), ("specs.x: structured_outputs.regex", {"x": {"regex": 3}}),
                                          ("specs.y: .*unexpected keyword", {"y": {"regexp": "a"}})])
def test_bad_config_names_the_field(field, value):
    name = field.split(".")[0]
    with pytest.raises((ValueError, TypeError), match=field):
        bench_grammar.BenchGrammarConfig(**{name: value})
