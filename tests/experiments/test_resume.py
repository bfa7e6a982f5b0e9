"""Resuming is opt-in everywhere: the `--resume` flag, kernel_bench's rows, reproduce_all passing it on."""

import io
import json
import sys

import pytest

from experiments import common, kernel_bench
from experiments.kernel_bench import KernelBenchConfig
from experiments.report import reproduce_all

# reproduce_all's steps by config name.
RESUMING = ("throughput", "parallel_sampling", "shared_prefix", "chatbot", "kernel_bench", "block_size", "preemption")
NOT_RESUMING = ("memory_waste", "bench_host", "serve_real")
MODULE_OF = {config: module for module, config in reproduce_all.STEPS}


@pytest.mark.parametrize("config", RESUMING + NOT_RESUMING)
def test_every_sweep_resumes_and_only_sweeps(config):
    run, _ = reproduce_all.load_step(MODULE_OF[config], config, quick=False)
    assert common.resumes(run) == (config in RESUMING)


def test_cli_passes_resume_only_when_asked(monkeypatch, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("seed: 3\n")
    seen = []

    def run(cfg, resume=False):
        seen.append((cfg.seed, resume))
        return {}

    for argv, expected in ((["--config", str(config)], False), (["--config", str(config), "--resume"], True)):
        monkeypatch.setattr(sys, "argv", ["x", *argv])
        common.main("d", KernelBenchConfig, run, str(config))
        assert seen.pop() == (3, expected)
    monkeypatch.setattr(sys, "argv", ["x", "--config", str(config), "--resume"])
    with pytest.raises(SystemExit):  # an experiment that never resumes has no --resume
        common.main("d", KernelBenchConfig, lambda cfg: {}, str(config))


def _fake_point(timed):
    def point(config, on_gpu, batch, context_len, block_size):
        timed.append((batch, context_len, block_size))
        return {"batch": batch, "context_len": context_len, "block_size": block_size, "paged_us": 2.0,
                "contiguous_us": 1.0, "paged_over_contiguous": 2.0, "bytes_moved": 1, "paged_gbps": 1.0}
    return point


def test_kernel_bench_resumes_rows_with_their_provenance(tmp_path, monkeypatch, capsys):
    timed = []
    monkeypatch.setattr(kernel_bench, "_point", _fake_point(timed))
    config = KernelBenchConfig(batch_sizes=[1], context_lens=[64, 128], block_sizes=[16],
                               output=str(tmp_path / "kb.json"), plot="")
    kernel_bench.run(config)
    assert timed == [(1, 64, 16), (1, 128, 16)]
    rows = json.loads((tmp_path / "kb.json").read_text())["rows"]
    stamp = rows[0]["provenance"]
    assert "git_sha" in stamp and "config" not in stamp
    timed.clear()
    kernel_bench.run(config)  # a plain run times everything again
    assert len(timed) == 2
    saved = json.loads((tmp_path / "kb.json").read_text())
    saved["rows"] = saved["rows"][:1]  # as if interrupted after the first row
    (tmp_path / "kb.json").write_text(json.dumps(saved))
    timed.clear()
    capsys.readouterr()
    result = kernel_bench.run(config, resume=True)
    assert timed == [(1, 128, 16)] and "reused 1 of 2 rows" in capsys.readouterr().out
    assert [r["context_len"] for r in result["rows"]] == [64, 128]
    assert result["rows"][0]["provenance"] == saved["rows"][0]["provenance"]


def test_reproduce_all_passes_resume_on_and_prints_above_its_bar(monkeypatch, tmp_path):
    calls = []

    def sweep(config, resume=False):
        calls.append(("sweep", resume))
        print("sweep summary")

    def once(config):
        calls.append(("once", None))

    class Config:
        output = "out.json"

    steps = {"a": sweep, "b": once}
    monkeypatch.setattr(reproduce_all, "STEPS", (("a", "a"), ("b", "b")))
    monkeypatch.setattr(reproduce_all, "load_step", lambda m, c, quick: (steps[m], Config()))
    monkeypatch.setattr(reproduce_all, "write_report", lambda results: tmp_path / "REPORT.md")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    reproduce_all.main(quick=False, resume=True)
    reproduce_all.main(quick=False)
    assert calls == [("sweep", True), ("once", None), ("sweep", False), ("once", None)]
    lines = out.getvalue().splitlines()
    assert lines[:3] == ["== a (a, output out.json)", "sweep summary", "== b (b, output out.json)"]


def test_lines_above_bars_writes_whole_lines_only():
    out = io.StringIO()
    stream = reproduce_all.LinesAboveBars(out, io.StringIO())
    stream.write("part")
    assert out.getvalue() == ""
    stream.write("ial\nnext\nta")
    assert out.getvalue() == "partial\nnext\n"
