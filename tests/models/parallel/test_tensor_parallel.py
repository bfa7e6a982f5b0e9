"""Runs tp_cases.py in a child pytest with 4 virtual CPU devices: its default cases here, its
slow cases in the slow tier.

XLA fixes the CPU device count when jax first initialises; this process has usually done so for
other tests already, so the tensor-parallel cases get a fresh interpreter with the flag set.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _run_cases(marks: str) -> None:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs", "-m", marks,
         "tests/models/parallel/tp_cases.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert "skipped" not in child.stdout, child.stdout[-2000:]


def test_tensor_parallel_cases_on_four_virtual_devices():
    _run_cases("not slow")


@pytest.mark.slow
def test_slow_tensor_parallel_cases_on_four_virtual_devices():
    _run_cases("slow")
