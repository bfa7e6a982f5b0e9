"""Every experiment's default config in order, then the figures and REPORT.md.

Each experiment writes its JSON and figures as its own entry point does; the report
(`experiments.report.document`) is then rewritten from the JSON files. The full run includes the slow
real-hardware benchmarks (kernel_bench, bench_host, serve_real), the real model's beam searches
(record_beams), the six paper panels of Figs. 12/13 with their sensitivity runs, and the ablations of
the figures outside the paper's range (ABLATIONS; quick mode keeps only their source-backed rows). `--quick`
skips those and runs shortened copies of the other configs (shorter traces, fewer points: the
overrides in QUICK) into results/quick/, with their own REPORT.md there (its beam-search replay
reads the committed results/beam_traces.npz). `--skip NAME ...` leaves out the named configs
(e.g. the real-hardware benchmarks, to rerun only what the simulator computes). `--resume` is
passed to every experiment that resumes (`experiments.common.call_run`), so an interrupted run
picks up where it stopped; without it every point is computed afresh.

On screen: an overall bar (experiments done, the one running) with each experiment's own bars
stacked under it; the experiments' summary lines and log records are printed above the bars.

    python -m experiments.report.reproduce_all [--quick] [--resume] [--skip CONFIG ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import logging
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from experiments.common import REPO_ROOT, call_run
from experiments.report.document import write_report
from jpaged.config import load_config

# The figures outside the paper's range, each rerun with one modelling choice changed at a time
# (configs/ablation/<name>.yaml); quick mode runs only their source-backed rows.
ABLATIONS = ("chatbot", "throughput_opt175b_sharegpt", "shared_prefix", "parallel_sampling")
# (module under experiments/, config under configs/) in order; the module's run(config) and its config
# class are looked up by name.
PANELS = ("throughput_opt13b_sharegpt", "throughput_opt66b_sharegpt", "throughput_opt175b_sharegpt",
          "throughput_opt13b_alpaca", "throughput_opt66b_alpaca", "throughput_opt175b_alpaca",
          "throughput_opt175b_alpaca_seqs1024", "throughput_opt13b_sharegpt_ft_host")  # Figs. 12/13 panels
STEPS = (("memory_waste", "memory_waste"), ("throughput", "throughput"),
         *(("throughput", panel) for panel in PANELS),
         ("record_beams", "record_beams"), ("parallel_sampling", "parallel_sampling"),
         ("shared_prefix", "shared_prefix"), ("shared_prefix.steps", "shared_prefix_steps"), ("chatbot", "chatbot"),
         *(("ablation", f"ablation/{name}") for name in ABLATIONS),
         ("kernel_bench", "kernel_bench"), ("kernel_bench", "kernel_bench_block_sizes"),
         ("block_size", "block_size"), ("preemption", "preemption"), ("chunked_prefill", "chunked_prefill"),
         ("fleet", "fleet"), ("spec_sim", "spec_sim"), ("bench.bench_host", "bench_host"),
         ("bench.serve_real", "serve_real"))
# Full run only: real hardware and the real model (kernel_bench, bench_host, serve_real, record_beams),
# and the long simulated panels (the default throughput config is their quick stand-in).
SLOW = {"kernel_bench", "kernel_bench_block_sizes", "bench_host", "serve_real", "record_beams", *PANELS}
CONFIG_CLASSES = {"memory_waste": "MemoryWasteConfig", "throughput": "ThroughputConfig",
                  "parallel_sampling": "ParallelSamplingConfig", "shared_prefix": "SharedPrefixConfig",
                  "chatbot": "ChatbotConfig", "kernel_bench": "KernelBenchConfig", "block_size": "BlockSizeConfig",
                  "preemption": "PreemptionConfig", "chunked_prefill": "ChunkedPrefillConfig", "fleet": "FleetConfig",
                  "spec_sim": "SpecSimConfig",
                  "record_beams": "RecordBeamsConfig", "bench.bench_host": "BenchHostConfig",
                  "bench.serve_real": "ServeRealConfig", "shared_prefix.steps": "SharedPrefixStepsConfig",
                  "ablation": "AblationConfig"}
# --quick: shorter traces and fewer points (the same code paths as the full configs).
QUICK = {
    "memory_waste": {"duration_s": 200.0, "picture_start_s": 100.0, "picture_window_s": 30.0},
    "throughput": {"duration_s": 120.0, "rates": {"vllm": [1.0, 1.5, 2.0, 2.5], "orca_oracle": [0.5, 0.75, 1.0, 1.5],
                                                  "orca_pow2": [0.5, 0.75, 1.0, 1.5], "orca_max": [0.25, 0.5, 0.75, 1.0],
                                                  "fastertransformer": [0.1, 0.2, 0.3, 0.4]}},
    "parallel_sampling": {"duration_s": 30.0, "widths": [2, 6],
                          "rates": {"parallel2": [2, 8, 16, 24], "parallel6": [0.5, 2, 6, 10],
                                    "beam2": [2, 8, 16, 24], "beam6": [0.5, 2, 6, 10]}},
    "shared_prefix": {"duration_s": 60.0, "rates": {"vllm_80": [20, 40, 60, 80], "orca_oracle_80": [10, 20, 30, 40],
                                                    "vllm_341": [10, 30, 50, 70], "orca_oracle_341": [4, 8, 12, 20]}},
    "chatbot": {"duration_s": 200.0, "rates": {"vllm": [0.5, 1.0, 1.5, 2.0], "orca_oracle": [0.25, 0.5, 1.0, 1.5],
                                               "orca_pow2": [0.25, 0.5, 1.0, 1.5], "orca_max": [0.25, 0.5, 1.0, 1.5]}},
    "shared_prefix_steps": {"duration_s": 30.0, "sustained_from": "results/quick/shared_prefix.json"},
    "ablation/chatbot": {"readings": ["source"]},
    "ablation/throughput_opt175b_sharegpt": {"readings": ["source"]},
    "ablation/shared_prefix": {"readings": ["source"]},
    "ablation/parallel_sampling": {"readings": ["source"]},
    "block_size": {"duration_s": 60.0, "block_sizes": [1, 4, 16, 64, 256]},
    "preemption": {"duration_s": 120.0, "block_sizes": [1, 4, 16, 64, 256], "seq_len": 256, "repeats": 2},
    "chunked_prefill": {"duration_s": 120.0, "rates": [1.0, 2.0, 3.0], "real": None},
    "fleet": {"replicas": [1, 4]},
}
_OUTPUT_FIELDS = ("output", "figure", "saving_figure", "pool_figure", "plot", "summary")


def load_step(module_name: str, config_name: str, quick: bool):
    """(run, config) of one step; under `quick` with QUICK's overrides and outputs in results/quick/."""
    module = importlib.import_module(f"experiments.{module_name}")
    config = load_config(REPO_ROOT / "configs" / f"{config_name}.yaml", getattr(module, CONFIG_CLASSES[module_name]))
    if quick:
        changes = dict(QUICK.get(config_name, {}))
        for name in _OUTPUT_FIELDS:
            value = getattr(config, name, "")
            if value:
                changes[name] = str(Path("results/quick") / Path(value).name)
        config = dataclasses.replace(config, **changes)
    return module.run, config


class LinesAboveBars(io.TextIOBase):
    """A stdout that prints each complete line above the progress bars on `bars` (tqdm clears
    them, the line is written, tqdm redraws them), so printed lines never split a bar."""

    def __init__(self, out, bars):
        self.out, self.bars, self.pending = out, bars, ""

    def write(self, text: str) -> int:
        """Buffers `text`; writes the complete lines it ends, above the bars."""
        lines, newline, self.pending = (self.pending + text).rpartition("\n")
        if newline:
            with tqdm.external_write_mode(file=self.bars):
                self.out.write(lines + newline)
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        """Flushes the underlying stream (a partial line stays buffered until its newline)."""
        self.out.flush()


def main(quick: bool, resume: bool = False, skip: tuple[str, ...] = ()) -> None:
    """Runs the steps (quick: the fast ones, shortened; none named in `skip`), then rewrites the report."""
    unknown = set(skip) - {c for _, c in STEPS}
    if unknown:
        raise ValueError(f"--skip: no step named {', '.join(sorted(unknown))}; steps: {', '.join(c for _, c in STEPS)}")
    steps = [(m, c) for m, c in STEPS if not (quick and (m in SLOW or c in SLOW)) and c not in skip]
    start = time.perf_counter()
    # All bars go to stderr (tqdm's default), where tqdm stacks an experiment's bars under this
    # one; the experiments' stdout and log records are written above them.
    with logging_redirect_tqdm(), contextlib.redirect_stdout(LinesAboveBars(sys.stdout, sys.stderr)):
        bar = tqdm(steps, desc="reproduce_all", unit="exp")
        for module_name, config_name in bar:
            bar.set_postfix(experiment=config_name, refresh=True)  # the bar shows the elapsed time itself
            run, config = load_step(module_name, config_name, quick)
            print(f"== {config_name} ({module_name}, output {config.output})")
            call_run(run, config, resume=resume)
        bar.close()
    results = REPO_ROOT / ("results/quick" if quick else "results")
    report = write_report(results)
    print(f"report       {report}")
    print(f"total_wall_s {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shortened configs into results/quick/")
    parser.add_argument("--resume", action="store_true",
                        help="each experiment that resumes keeps its finished points (same settings) and runs the rest")
    parser.add_argument("--skip", nargs="+", default=[], metavar="CONFIG",
                        help="leave out these steps (config names), e.g. kernel_bench bench_host serve_real")
    args = parser.parse_args()
    main(args.quick, args.resume, tuple(args.skip))
