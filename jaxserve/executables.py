"""Warm-up's compiled executables, kept and called by argument shapes, and a store of them on
disk for the next start.

A jitted function traces and lowers its program again on its first call even when the same
program was just compiled by `lower().compile()` (and JAX's persistent cache is keyed by the
lowered program, so a warm start traces and lowers everything before it finds anything).
So warm-up compiles each (function, argument shapes, static arguments) once, the runner calls
the executable directly (`Executables.get`), and the executables are serialized to a store
beside JAX's compilation cache: a later start with the same program loads them, neither
tracing nor lowering. A shape warm-up did not build goes through the jitted function as before.

Stale entries must be impossible: an entry's file name hashes its key (function, argument
shapes and dtypes, static arguments) with the context (`context_digest`: the jaxserve and
pallas_kernels sources, jax/jaxlib/flax versions, JAX's config and XLA flags, the devices, and
what the caller adds: the model and engine configs, the abstract weights and KV cache). A miss
or an unreadable entry compiles; a failed write only logs. Loading unpickles: the store is
trusted as a compilation cache is.

The store replaces JAX's persistent cache (the engine no longer enables it): an XLA:CPU
executable that JAX's cache deserialized serializes again without its kernels ("Function ...
not found" when the stored copy runs; jax 0.10.2). So only fresh compilations are stored: one
that came from JAX's cache anyway (JAX_COMPILATION_CACHE_DIR set by the user) serves, unstored.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.metadata
import logging
import os
import pathlib
import pickle
import shutil
import tempfile
import threading
from typing import Any, Callable, Hashable

import jax
import numpy as np
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

# Context directories kept in the store (the most recently used): each source change makes a new one.
KEEP_CONTEXTS = 8


_jax_cache_hits = threading.local()   # this thread's hits in JAX's persistent cache
# XLA:CPU executables load one at a time: two threads deserializing at once segfaulted in CI (jax
# 0.10.2, 2026-11-27). It costs a warm start of the embedded model ~1 s (2.3 -> 3.4 s for its 39
# executables on 2 cores); compiles beside a load, and loads on accelerators, still run in parallel.
_cpu_loading = threading.Lock()


def _count_jax_cache_hit(event: str, *args, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _jax_cache_hits.count = getattr(_jax_cache_hits, "count", 0) + 1


jax.monitoring.register_event_listener(_count_jax_cache_hit)


def shapes(args) -> tuple:
    """The (shape, dtype) of each array of `args` (a pytree): what a jit dispatches on."""
    return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(args))


def abstract(tree):
    """ShapeDtypeStructs (with their shardings) for the arrays of a pytree: lowered, nothing is donated."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def key(name: str, args, **static) -> tuple:
    """An executable's key: the function's name, its dynamic arguments' shapes, its static ones."""
    return name, shapes(args), tuple(sorted(static.items()))


@functools.cache
def source_digest() -> str:
    """sha256 of the .py files of jaxserve and pallas_kernels: any code change is a new program."""
    h = hashlib.sha256()
    for package in ("jaxserve", "pallas_kernels"):
        root = pathlib.Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def context_digest(devices, *parts) -> str:
    """sha256 of everything besides a key that decides the compiled program on `devices`."""
    versions = [importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax")]
    platform = [(d.platform, d.device_kind, d.id, d.process_index, d.client.platform_version) for d in devices]
    env = [os.environ.get(v, "") for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")]
    config = sorted(jax.config.values.items())
    # This process's index too: an executable serialized by one host names devices as it sees them.
    text = repr((source_digest(), versions, platform, jax.process_count(), jax.process_index(), env, config, parts))
    return hashlib.sha256(text.encode()).hexdigest()


class Executables:
    """Compiled executables by key; with a directory, stored there under the context's digest."""

    def __init__(self, directory: str | None, devices, context: str):
        self.directory = None if directory is None else os.path.join(os.path.expanduser(directory), context[:32])
        self.devices = list(devices)
        self.table: dict[Hashable, Any] = {}
        self.loaded = self.compiled = 0

    def get(self, k: Hashable):
        return self.table.get(k)

    def build(self, lowerings: dict[Hashable, Callable[[], Any]]) -> None:
        """Load or compile (then store) each key's executable; `lowerings[k]()` gives its
        jax.stages.Lowered. In threads: XLA compiles with the GIL released."""
        todo = {k: lower for k, lower in lowerings.items() if k not in self.table}
        with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
            for k, (executable, loaded) in zip(todo, pool.map(self._load_or_compile, todo.items())):
                self.table[k] = executable
                self.loaded += loaded
                self.compiled += not loaded
        if self.directory is not None and os.path.isdir(self.directory):
            try:   # another process may be pruning the same store
                os.utime(self.directory)   # most recently used: kept by _prune
                _prune(os.path.dirname(self.directory), KEEP_CONTEXTS)
            except OSError as e:
                log.warning("executable store: pruning %s failed (%s)", os.path.dirname(self.directory), e)

    def _load_or_compile(self, item):
        k, lower = item
        path = None if self.directory is None else os.path.join(
            self.directory, hashlib.sha256(repr(k).encode()).hexdigest() + ".bin")
        if path is not None and os.path.exists(path):
            try:
                on_cpu = self.devices[0].platform == "cpu"
                with open(path, "rb") as f, _cpu_loading if on_cpu else contextlib.nullcontext():
                    return serialize_executable.deserialize_and_load(*pickle.load(f),
                                                                 execution_devices=self.devices), True
            except Exception as e:   # a damaged or foreign file: compile instead
                log.warning("executable store: %s unreadable (%s: %s), compiling", path, type(e).__name__, e)
        hits = getattr(_jax_cache_hits, "count", 0)
        executable = lower().compile()
        if getattr(_jax_cache_hits, "count", 0) > hits:
            log.info("executable store: %s came from JAX's persistent cache: not stored", k[0])
        elif path is not None:
            try:
                _write(path, pickle.dumps(serialize_executable.serialize(executable)))
            except Exception as e:   # e.g. a backend that cannot serialize, a read-only disk
                log.warning("executable store: %s not written (%s: %s)", path, type(e).__name__, e)
        return executable, False


def _write(path: str, data: bytes) -> None:
    """Whole or not at all: another process may be reading or writing the same entry."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _prune(store: str, keep: int) -> None:
    contexts = sorted(pathlib.Path(store).iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in contexts[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def lower(fn, *args, **kwargs):
    """fn.lower(*args, **kwargs) for a jitted function or a functools.partial of one."""
    if isinstance(fn, functools.partial):
        return fn.func.lower(*fn.args, *args, **fn.keywords, **kwargs)
    return fn.lower(*args, **kwargs)
