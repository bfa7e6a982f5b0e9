"""`jpaged serve`'s prefix-cache flags (host tier size and policy, pinned prefixes) reach the engine,
and bad values are refused naming the field."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from jpaged.entrypoints import cli
from jpaged.entrypoints.engine_args import engine_config
from jpaged.entrypoints.engine_flags import engine_args_from

pytest.importorskip("uvicorn")  # (the serve extra, for `jpaged serve` below)

REPO = Path(__file__).resolve().parents[2]


def _serve_args(*argv):
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", "--model", "tiny-opt", *argv])


def test_flags_reach_the_engine_config():
    args = _serve_args("--enable-prefix-caching", "--num-host-cache-blocks", "64", "--eviction-policy", "arc",
                       "--pin-prefix", "You are a helpful assistant.", "--pin-prefix", "Translate:")
    assert args.pinned_prefixes == ["You are a helpful assistant.", "Translate:"]
    cache = engine_config("tiny-opt", **engine_args_from(args)).cache
    assert (cache.enable_prefix_caching, cache.num_host_cache_blocks, cache.eviction_policy) == (True, 64, "arc")
    assert _serve_args().pinned_prefixes is None


@pytest.mark.parametrize("argv, names", [
    (["--num-host-cache-blocks", "64"], ["cache.num_host_cache_blocks", "cache.enable_prefix_caching"]),
    (["--enable-prefix-caching", "--num-host-cache-blocks", "-1"], ["cache.num_host_cache_blocks", "-1"]),
    (["--eviction-policy", "fifo"], ["--eviction-policy", "fifo", "lru", "arc"]),
])
def test_bad_values_are_refused_naming_the_field(argv, names):
    out = subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--model", "tiny-opt", "--no-warmup",
                          *argv], check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    for name in names:
        assert name in out.stderr, out.stderr
