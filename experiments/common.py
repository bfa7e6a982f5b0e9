"""Helpers shared by experiment entry points: CLI parsing, provenance, atomic JSON results."""

from __future__ import annotations

import argparse
import datetime
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


def provenance(config: Any, seed: int | None = None, device: str | None = None) -> dict:
    """Where a result came from: code version, library versions, device, config, seed, date."""
    info = {"git_sha": git_sha(), "python": platform.python_version(), "machine": platform.machine(),
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


def main(description: str, config_cls: type[T], run: Callable[[T], dict], default_config: str) -> dict:
    """Parses `--config`, loads it strictly into `config_cls`, and calls `run(config)`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=default_config, help=f"YAML config (default {default_config})")
    args = parser.parse_args()
    return run(load_config(args.config, config_cls))
