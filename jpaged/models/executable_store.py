"""Compiled programs kept on disk and called again without tracing: a restart in seconds.

JAX's persistent compilation cache (jpaged.executors.warmup.enable_compilation_cache) skips XLA's
compilation of a program it has seen, but its key is a hash of the lowered program, so every start
still traces and lowers each program to find its entry: about 0.2 s of CPU a model step here, most
of a start with a filled cache. This store keys a program by what determines it without tracing:

- its owner's description of the function (`StoredJit.identity`: the model's spec, the attention
  backend, ... everything the traced function closes over);
- the abstract values of its arguments (tree structure, shapes, dtypes, weak types) and the values
  of its static arguments;
- `fingerprint()`: the jax and jaxlib versions, the platform, its devices and the CPU's features,
  XLA_FLAGS and jax's numeric options, and the source of the `jpaged` and `pallas_kernels`
  packages, so any change to the code misses (and the XLA cache then serves the compilation).

An entry holds the executable as `jax.experimental.serialize_executable` writes it and the
output's tree structure; loading one is `deserialize_and_load`. Entries live in
`<folder>/<fingerprint>/<key>.bin`, written whole (a temporary file renamed into place), so
processes sharing the folder never read half an entry; an entry that fails to load is dropped and
its program compiled again (and stored, unless JAX's cache served it: see `_CACHE_HIT_EVENT`). Loading an entry runs code from the folder (a pickle and an executable), as
JAX's own cache does: the folder must be as trusted as the code.

Only a process with one device stores programs (an executable names its devices); with more,
`StoredJit` compiles ahead of time (`lower().compile()`) and keeps its programs in memory only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

# Fingerprint folders not used for this long are removed when a store opens: each code change
# starts a new one.
STALE_AFTER_S = 7 * 24 * 3600
_SOURCE_SUFFIXES = (".py", ".cc", ".c", ".h", ".json")
_NUMERIC_OPTIONS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                    "jax_threefry_partitionable")


def _source_digest() -> str:
    """sha256 of every source file of the packages whose code becomes programs."""
    import pallas_kernels  # (the runner imports it anyway)

    digest = hashlib.sha256()
    for root in (Path(__file__).resolve().parents[1], Path(pallas_kernels.__file__).resolve().parent):
        for path in sorted(p for p in root.rglob("*") if p.suffix in _SOURCE_SUFFIXES and "__pycache__" not in p.parts):
            digest.update(str(path.relative_to(root.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_features() -> str:
    """The CPU's feature flags (XLA:CPU compiles for the host's instruction set), where Linux lists them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


@functools.cache
def fingerprint() -> str:
    """What, besides a program's own key, decides whether a stored executable is still the one
    this process would compile (see the module docstring); hex, 24 characters."""
    devices = jax.local_devices()
    parts = [jax.__version__, importlib.metadata.version("jaxlib"),
             jax.default_backend(), str([d.device_kind for d in devices]), str(jax.process_count()),
             platform.machine(), _cpu_features(), os.environ.get("XLA_FLAGS", ""),
             str([(name, getattr(jax.config, name, None)) for name in _NUMERIC_OPTIONS]), _source_digest()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def signature(args: tuple, kwargs: dict) -> Hashable:
    """The abstract values of a call's arguments: (tree structure, (shape, dtype, weak type,
    sharding) per leaf; a host array's sharding is None)."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    return tree, tuple(map(_leaf_signature, leaves))


def _leaf_signature(x: Any) -> tuple:
    if not hasattr(x, "dtype"):  # a Python scalar: jax takes it weakly typed
        return np.shape(x), np.result_type(x), True, None
    return x.shape, x.dtype, getattr(x, "weak_type", False), getattr(x, "sharding", None)


class ExecutableStore:
    """Serialized executables in `folder/<fingerprint>/`, by key (see the module docstring)."""

    def __init__(self, folder: str | Path):
        """A store under `folder`. Nothing touches jax or the disk until its first use: a
        multi-process run must call jax.distributed.initialize before any backend exists."""
        self.root = Path(folder)
        self.loaded = self.saved = 0  # entries this process read back and wrote
        self._folder: Path | None = None
        self._lock = threading.Lock()

    @property
    def folder(self) -> Path:
        """This code's fingerprint folder, created at first use; other fingerprints' folders unused
        for STALE_AFTER_S are removed then."""
        with self._lock:
            if self._folder is None:
                folder = self.root / fingerprint()
                folder.mkdir(parents=True, exist_ok=True)
                os.utime(folder)  # marks this fingerprint as in use
                for other in self.root.iterdir():
                    if other != folder and other.is_dir() and time.time() - other.stat().st_mtime > STALE_AFTER_S:
                        shutil.rmtree(other, ignore_errors=True)
                self._folder = folder
            return self._folder

    def path(self, key: str) -> Path:
        """Where the entry `key` lives."""
        return self.folder / f"{key}.bin"

    def load(self, key: str, args: tuple, kwargs: dict) -> jax.stages.Compiled | None:
        """The stored executable `key` for arguments shaped like (`args`, `kwargs`), or None when
        there is none or it does not load (the entry is then dropped and the program compiled again)."""
        path = self.path(key)
        try:
            payload, out_tree = pickle.loads(path.read_bytes())
            in_tree = jax.tree.structure((args, kwargs))
            program = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
        except FileNotFoundError:
            return None
        except Exception as error:  # a corrupt or foreign entry: dropped, and the program compiled again
            log.warning("stored executable %s did not load (%s: %s); compiling it", path, type(error).__name__, error)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return program

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Writes `compiled` as entry `key`, whole or not at all; an executable that cannot be
        serialized is left out (logged)."""
        try:
            payload, _, out_tree = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as error:
            log.debug("not storing %s: %s", key, error)
            return
        try:
            with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".tmp", delete=False) as handle:
                handle.write(pickle.dumps((payload, out_tree)))
            os.replace(handle.name, self.path(key))
        except OSError as error:  # a full disk, a folder removed meanwhile: the program still runs
            log.warning("could not store executable %s: %s", key, error)
            return
        self.saved += 1


_store: ExecutableStore | None = None


def enable(folder: str | Path | None) -> ExecutableStore | None:
    """Makes `folder` the store every StoredJit loads from and saves to (None: no store)."""
    global _store
    _store = None if folder is None else ExecutableStore(folder)
    return _store


def current() -> ExecutableStore | None:
    """The store `enable` opened, or None."""
    return _store


# JAX's event for a program read from its persistent cache. Such an executable runs, but on
# XLA:CPU (jax 0.10 and 0.12 alike) serializing it again gives one that fails when it runs
# ("Function ... not found"): it is never stored (`_cache_hits` counts them per thread).
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = threading.local()
_listening = False
_listen_lock = threading.Lock()


def _count_cache_hit(name: str, **_) -> None:
    if name == _CACHE_HIT_EVENT:
        _cache_hits.count = getattr(_cache_hits, "count", 0) + 1


def compiler_options() -> dict[str, Any] | None:
    """XLA options for the programs StoredJit compiles: on CPU, LLVM's default optimisation level (2)
    instead of XLA's "aggressive" (3), unless XLA_FLAGS sets a level. The generated code gives the
    same bits (the float arithmetic is the same either way: no fast-math at any level) at the same
    step time, and compiles 5-25% faster (docs/notes/compile-grid.md)."""
    if jax.default_backend() != "cpu" or "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_backend_optimization_level": 2}


def _compiled_afresh(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """(`lowered` compiled, whether XLA compiled it here rather than JAX's cache serving it)."""
    global _listening
    with _listen_lock:
        if not _listening:
            jax.monitoring.register_event_listener(_count_cache_hit)
            _listening = True
    before = getattr(_cache_hits, "count", 0)
    program = lowered.compile(compiler_options=compiler_options())
    return program, getattr(_cache_hits, "count", 0) == before


def _named(fun: Callable, name: str) -> Callable:
    """`fun` under `name` (its signature kept, for jit's static arguments)."""
    @functools.wraps(fun)
    def named(*args, **kwargs):
        return fun(*args, **kwargs)
    named.__name__ = named.__qualname__ = name
    return named


class StoredJit:
    """`jax.jit(fun, **jit_kwargs)` called through ahead-of-time compiled programs, one per
    abstract signature of its arguments, loaded from the store when it holds them (one device).

    `identity` must name everything the traced function depends on besides its arguments and the
    code: two StoredJits with equal identities and equal argument signatures share entries. The
    jitted function is named after the code's fingerprint, so a program of changed code misses
    JAX's cache, compiles and is stored (an executable JAX's cache served cannot be).
    """

    def __init__(self, fun: Callable, identity: str, *, static_argnames: tuple[str, ...] = (), **jit_kwargs):
        self.fun = fun
        self.identity = identity
        self.static_argnames = static_argnames
        self.jit_kwargs = jit_kwargs
        self.programs: dict[Hashable, jax.stages.Compiled] = {}
        # position -> (the dict last passed there, its signature): the weights, passed as the same
        # dict every call, are not walked again (51 leaves for the asset model: ~0.25 ms a call).
        self._seen: dict[int, tuple[Any, Hashable]] = {}
        self._jitted = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        """The jitted function's name, after the code's fingerprint; its programs' HLO modules are
        "jit_" + name."""
        return f"{getattr(self.fun, '__name__', 'program').strip('_')}_{fingerprint()[:8]}"

    @property
    def jitted(self) -> Any:
        """The jitted function (built at first use: the fingerprint needs jax's devices)."""
        with self._lock:
            if self._jitted is None:
                self._jitted = jax.jit(_named(self.fun, self.name), static_argnames=self.static_argnames,
                                       **self.jit_kwargs)
            return self._jitted

    def __call__(self, *args, **kwargs):
        """Runs the program of these arguments' signature, loading or compiling it first if new."""
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        program = self.programs.get(self._signature(args, kwargs, dynamic))
        if program is None:
            self.prepare(*args, **kwargs)()
            program = self.programs[self._signature(args, kwargs, dynamic)]
        return program(*args, **dynamic)

    def prepare(self, *args, **kwargs) -> Callable[[], None]:
        """Gets the program of these arguments ready in two halves: the Python half (tracing and
        lowering when no stored entry exists) runs now; the returned call loads or compiles it,
        may run on another thread (XLA releases the GIL) and makes it this function's."""
        dynamic = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        sig = self._signature(args, kwargs, dynamic)
        if sig in self.programs:
            return lambda: None
        store = current() if jax.device_count() == 1 else None
        key = None if store is None else self._key(sig)
        if store is not None and store.path(key).exists():
            def load():
                program = store.load(key, args, dynamic)
                if program is None:  # unreadable: compile it after all
                    program = self._compile(self.jitted.lower(*args, **kwargs), store, key)
                self._keep(sig, program)
            return load
        lowered = self.jitted.lower(*args, **kwargs)
        return lambda: self._keep(sig, self._compile(lowered, store, key))

    @staticmethod
    def _compile(lowered: jax.stages.Lowered, store: ExecutableStore | None, key: str | None) -> jax.stages.Compiled:
        """`lowered` compiled, and stored when XLA compiled it here."""
        if store is None:
            return lowered.compile(compiler_options=compiler_options())
        program, afresh = _compiled_afresh(lowered)
        if afresh:
            store.save(key, program)
        else:
            log.debug("not storing %s: JAX's cache served it", key)
        return program

    def _keep(self, sig: Hashable, program: jax.stages.Compiled) -> None:
        with self._lock:
            self.programs.setdefault(sig, program)

    def _signature(self, args: tuple, kwargs: dict, dynamic: dict) -> Hashable:
        """(static values, each positional argument's signature, the keyword arrays' signature).
        A dict argument that is the same object as last call keeps its signature: the caller never
        changes one in place (a program of the wrong signature would refuse the call anyway)."""
        cached, rest = [], []
        for i, arg in enumerate(args):
            if not isinstance(arg, dict):  # (arrays are not kept alive here)
                rest.append(arg)
                continue
            seen = self._seen.get(i)
            if seen is None or seen[0] is not arg:
                seen = self._seen[i] = (arg, signature((arg,), {}))
            cached.append((i, seen[1]))
        statics = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        return statics, tuple(cached), signature(tuple(rest), dynamic)

    def _key(self, sig: Hashable) -> str:
        return hashlib.sha256(f"{self.identity}\n{sig!r}".encode()).hexdigest()[:32]
