"""Test-session settings: compiled executables are shared between the many small engines the tests build.

Every test that builds an engine builds a fresh executor, whose jitted step closures XLA would
compile again even when the program is the same as an earlier test's. A persistent compilation
cache in a directory private to this session (empty at its start, so runs stay independent; CI
shares one across its runs: JPAGED_TEST_XLA_CACHE) lets later tests load those executables instead
of compiling them.
"""

import os
import sys
import tempfile

import pytest

# Set through the environment, which jax reads when it is first imported: the pure-Python tests
# (tests/core) never import jax, and the test subprocesses share the cache. CI sets
# JPAGED_TEST_XLA_CACHE to one folder for all the pytest runs of one CI run (the default suite, the
# newest-jax block, the slow tier). Otherwise the folder is made here and put in the environment,
# so pytest-xdist's workers (spawned after this module loads in the controlling process) share it:
# a program one worker compiled, the other loads. The controller's TemporaryDirectory removes it.
_CACHE = None if os.environ.get("JPAGED_TEST_XLA_CACHE") else tempfile.TemporaryDirectory(prefix="jpaged-test-xla-cache-")
if _CACHE is not None:
    os.environ["JPAGED_TEST_XLA_CACHE"] = _CACHE.name
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JPAGED_TEST_XLA_CACHE"]
# jpaged's own disk caches (the executable store that LLM(...) and `jpaged serve` open, the native
# kernels' builds) beside it, not in the user's ~/.cache/jpaged: a run writes only its own folder.
os.environ.setdefault("JPAGED_CACHE_DIR", os.path.join(os.environ["JPAGED_TEST_XLA_CACHE"], "jpaged"))
# On a GPU the two workers share the device: each allocates what it uses, not 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Engines that size their KV pool from free host memory take 256 MiB here, not the 4 GiB a user's
# gets (jpaged.executors.kv_sizing): the suite builds many engines, and a few alive at once at
# 4 GiB each exhausted this 24 GB machine. (Set before the tests' subprocesses inherit it.)
os.environ.setdefault("JPAGED_CPU_KV_CACHE_BYTES", str(256 * 2**20))
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


@pytest.fixture(autouse=True)
def _executable_store():
    """Every test that runs jax runs with the session's executable store open
    (jpaged.models.executable_store, under JPAGED_CACHE_DIR, shared by the workers), as a served
    engine does: an engine of a config another test built loads its programs instead of tracing
    them. (Tests that never imported jax leave it alone: it would import jax.)"""
    if "jax" in sys.modules:
        from jpaged.models import executable_store

        if executable_store.current() is None:
            executable_store.enable(os.path.join(os.environ["JPAGED_CACHE_DIR"], "executables"))
    yield
