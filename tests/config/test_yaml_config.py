"""Every committed config loads under the strict loader (duplicate keys, YAML 1.2 floats, NaN and
range checks included) into its experiment's config dataclass. The bad cases are rows of
tests/engine/test_engine_bad_input.py."""

import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from jpaged.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
GROUPS = ("bench", "peers", "lm", "report")  # experiments/<group>/<experiment>.py; figures are experiments/<name>/


def _module(name):
    """The module `name` (experiments.x.y) or None when there is none."""
    try:
        return importlib.import_module(name) if importlib.util.find_spec(name) is not None else None
    except ModuleNotFoundError:  # a parent package that does not exist
        return None


def config_class(stem):
    """The Config dataclass of the experiment a configs/<stem>.yaml belongs to: the longest prefix of
    the stem naming an experiment (a figure package, a module of a group, or a package's module named
    by the rest, as conversation_cpu -> experiments/conversation/cpu.py); the rest names a variant."""
    parts = stem.split("_")
    for cut in range(len(parts), 0, -1):
        name, rest = "_".join(parts[:cut]), "_".join(parts[cut:])
        candidates = ([f"experiments.{name}.{rest}"] if rest else []) + [f"experiments.{name}"] + [
            f"experiments.{group}.{name}" for group in GROUPS]
        for module in filter(None, map(_module, candidates)):
            classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
                       if c.__module__ == module.__name__ and c.__name__.endswith("Config") and dataclasses.is_dataclass(c)]
            if len(classes) == 1:
                return classes[0]
    raise LookupError(f"configs/{stem}.yaml: no experiment module with one *Config dataclass matches its name")


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_committed_config_loads(path):
    config = load_config(path, config_class(path.stem))
    assert dataclasses.is_dataclass(config)
