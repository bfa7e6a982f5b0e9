"""Test-session settings: compiled executables are shared between the many small engines the tests build.

Every test that builds an engine builds a fresh executor, whose jitted step closures XLA would
compile again even when the program is the same as an earlier test's. A persistent compilation
cache in a directory private to this session (empty at its start, so runs stay independent) lets
later tests load those executables instead of compiling them.
"""

import tempfile

import jax

_CACHE = tempfile.TemporaryDirectory(prefix="jpaged-test-xla-cache-")
jax.config.update("jax_compilation_cache_dir", _CACHE.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
