"""The executable store (jpaged.models.executable_store): a program compiled once is loaded by a
later StoredJit of the same identity without tracing, computes the same, and any difference in
identity, shapes, dtypes, static values or the code's fingerprint is another entry. The restart of
a whole engine from the store is tests/executors/test_warmup.py's."""

from __future__ import annotations

import logging
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.models import executable_store
from jpaged.models.executable_store import StoredJit


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_store, "_store", None)  # restored after the test
    return executable_store.enable(tmp_path / "executables")


def counted(traces: list, name: str) -> StoredJit:
    """A fresh StoredJit (as a restarted process builds) of one function named `name` (each test
    its own: the session's JAX cache would serve another test's programs); `traces` grows at
    each trace."""
    def step(pool, x, *, scale):
        traces.append(x.shape)
        return pool + scale * x.sum(), x * 2
    step.__name__ = name
    return StoredJit(step, "step", donate_argnums=(0,), static_argnames=("scale",))


def test_a_stored_program_is_loaded_without_tracing_and_computes_the_same(store):
    traces = []
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    pool = jnp.zeros(4)
    first = counted(traces, "loaded")(pool, x, scale=2.0)
    assert pool.is_deleted()  # donated
    assert (store.saved, store.loaded, len(traces)) == (1, 0, 1)
    again = counted(traces, "loaded")
    pool = jnp.zeros(4)
    second = again(pool, x, scale=2.0)
    assert (store.saved, store.loaded, len(traces)) == (1, 1, 1)  # loaded: no trace
    assert pool.is_deleted()  # the loaded program still donates the pool
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(again.programs) == 1


def test_identity_shapes_dtypes_and_static_values_are_each_their_own_entry(store):
    traces = []
    fn = counted(traces, "entries")
    x = np.ones((2, 3), np.float32)
    fn(jnp.zeros(4), x, scale=1.0)
    fn(jnp.zeros(4), x, scale=1.0)  # the same signature: the program in memory
    fn(jnp.zeros(4), np.ones((2, 4), np.float32), scale=1.0)  # another shape
    fn(jnp.zeros(4), x.astype(np.float16), scale=1.0)  # another dtype
    fn(jnp.zeros(4), x, scale=3.0)  # another static value
    assert store.saved == len(fn.programs) == len(traces) == 4
    other = counted(traces, "entries")
    other.identity = "another step"  # e.g. another model spec or attention backend
    other(jnp.zeros(4), x, scale=1.0)
    assert len(traces) == 5 and store.loaded == 0  # not the first program's entry
    # (here the same code, so JAX's cache served it, and such an executable is never stored)
    assert store.saved == len(list(store.folder.glob("*.bin"))) == 4


def test_an_executable_from_jaxs_cache_is_not_stored_and_the_next_start_compiles_it(store):
    """A program JAX's persistent cache serves cannot be serialized again on XLA:CPU (it would
    fail when run): it is not stored, and a store without its entry compiles it afresh."""
    x = np.ones((2, 3), np.float32)
    expected = counted([], "from_jax")(jnp.zeros(4), x, scale=1.0)
    for entry in store.folder.glob("*.bin"):
        entry.unlink()  # a store emptied while JAX's cache (this session's) keeps the program
    served = counted([], "from_jax")(jnp.zeros(4), x, scale=1.0)
    assert store.saved == 1 and not list(store.folder.glob("*.bin"))
    np.testing.assert_array_equal(served[0], expected[0])


def test_a_corrupt_entry_is_dropped_and_its_program_compiled_again(store, caplog):
    traces = []
    x = np.ones((2, 3), np.float32)
    expected = counted(traces, "corrupt")(jnp.zeros(4), x, scale=1.0)
    (entry,) = store.folder.glob("*.bin")
    entry.write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING):
        got = counted(traces, "corrupt")(jnp.zeros(4), x, scale=1.0)
    assert "did not load" in caplog.text and str(entry) in caplog.text
    np.testing.assert_array_equal(got[0], expected[0])
    assert store.loaded == 0 and len(traces) == 2
    # Dropped; (here JAX's cache served the compilation again, so it is not stored anew).
    assert not entry.exists()


def test_a_new_fingerprint_misses_and_stale_fingerprints_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_store, "_store", None)
    old = executable_store.enable(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing on disk before its first use
    counted([], "fingerprint")(jnp.zeros(4), np.ones(3, np.float32), scale=1.0)
    week_ago = time.time() - executable_store.STALE_AFTER_S - 60
    os.utime(old.folder, (week_ago, week_ago))
    # New code (or another jax, device, XLA_FLAGS...): another folder; the unused one goes.
    monkeypatch.setattr(executable_store, "fingerprint", lambda: "0" * 24)
    new = executable_store.enable(tmp_path)
    assert new.folder != old.folder and not old.folder.exists()
    traces = []
    counted(traces, "fingerprint")(jnp.zeros(4), np.ones(3, np.float32), scale=1.0)
    assert (new.loaded, new.saved, len(traces)) == (0, 1, 1)


def test_without_a_store_programs_stay_in_memory(monkeypatch):
    monkeypatch.setattr(executable_store, "_store", None)
    traces = []
    fn = counted(traces, "memory")
    for _ in range(3):
        fn(jnp.zeros(4), np.ones(3, np.float32), scale=1.0)
    assert len(traces) == len(fn.programs) == 1


def test_the_fingerprint_covers_the_code():
    """Any source file of the packages changes the fingerprint's digest (read from disk each time)."""
    digest = executable_store._source_digest()
    assert digest == executable_store._source_digest() and len(executable_store.fingerprint()) == 24


def test_a_store_that_cannot_write_still_runs_the_program(store, caplog):
    shutil.rmtree(store.folder)  # e.g. removed by another process's clean-up, or a full disk
    with caplog.at_level(logging.WARNING):
        out = counted([], "unwritable")(jnp.zeros(4), np.ones(3, np.float32), scale=1.0)
    np.testing.assert_array_equal(out[0], np.full(4, 3.0, np.float32))
    assert store.saved == 0 and "could not store" in caplog.text


def test_programs_compile_at_llvms_default_level_on_cpu_unless_xla_flags_set_one(monkeypatch):
    """Level 2, not XLA's 3: the same bits, compiled faster (docs/notes/compile-grid.md); a level the
    user set in XLA_FLAGS is theirs."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert executable_store.compiler_options() == {"xla_backend_optimization_level": 2}
    step = StoredJit(lambda x: jnp.tanh(x @ x.T).sum(-1), "tanh")
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(step(x)), np.asarray(jax.jit(lambda x: jnp.tanh(x @ x.T).sum(-1))(x)))
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=3")
    assert executable_store.compiler_options() is None
