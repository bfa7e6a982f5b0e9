"""Helpers shared by experiment entry points: CLI parsing, provenance, atomic JSON results.

An experiment resumes when its `run` takes a `resume` keyword (`resumes(run)`): its CLI then has
`--resume`, and `reproduce_all --resume` passes it on. Without it, a run computes every point.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

from jpaged.config import config_to_dict, load_config

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parent.parent


def git_sha() -> str:
    """The repository's HEAD commit, '+dirty' when tracked code differs from it; 'unknown' outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        # results/ is what experiments write: a sweep rewriting it does not make the code dirty.
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], cwd=REPO_ROOT, capture_output=True, text=True,
                               check=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# CPU features that change which native kernel paths run (pallas_kernels/native/*.cc) and how fast.
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """The host CPU as /proc/cpuinfo names it, with the vector features the kernels use, e.g.
    "AMD EPYC (avx2 fma)"; the machine name where /proc/cpuinfo is missing."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    return f"{fields.get('model name', platform.machine())} ({' '.join(f for f in _CPU_FLAGS if f in flags)})"


def provenance(config: Any, seed: int | None = None, device: str | None = None) -> dict:
    """Where a result came from: code version, library versions, device, host CPU, config, seed, date."""
    info = {"git_sha": git_sha(), "python": platform.python_version(), "machine": platform.machine(),
            "cpu": cpu_description(),
            "config": config_to_dict(config), "seed": seed,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    try:
        import jax
        import jaxlib

        info.update(jax=jax.__version__, jaxlib=jaxlib.__version__,
                    device=device or jax.devices()[0].device_kind)
    except ImportError:
        info["device"] = device or "none"
    return info


def sha256_of(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (an input an experiment read: its results change with it)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def point_provenance(run_provenance: dict) -> dict:
    """What each point of a sweep records about the run that computed it: the run's provenance
    without the config (the settings that shape a point are stored once, beside the points)."""
    return {k: v for k, v in run_provenance.items() if k != "config"}


def resumes(run: Callable[..., dict]) -> bool:
    """Whether an experiment's `run` can keep finished points of an earlier run (`resume=`)."""
    return "resume" in inspect.signature(run).parameters


def call_run(run: Callable[..., dict], config: Any, resume: bool = False) -> dict:
    """`run(config)`, with `resume` passed to an experiment that resumes (the others always
    compute everything, so `resume` changes nothing for them)."""
    return run(config, resume=resume) if resumes(run) else run(config)


def write_json(path: str | Path, data: dict) -> Path:
    """Writes `data` as JSON atomically: a temp file in the same folder, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False, default=float)
        f.write("\n")
    os.replace(tmp, path)
    return path


def main(description: str, config_cls: type[T], run: Callable[..., dict], default_config: str) -> dict:
    """Parses `--config` (and `--resume` where `run` resumes), loads the config strictly into
    `config_cls`, and calls `run(config)` (`run(config, resume=...)`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help=f"YAML config (default {default_config})")
    if resumes(run):
        parser.add_argument("--resume", action="store_true",
                            help="keep the points of the output JSON made with the same settings (each "
                                 "keeps the provenance of the run that computed it); compute only the rest")
    args = parser.parse_args()
    return call_run(run, load_config(args.config, config_cls), resume=getattr(args, "resume", False))
