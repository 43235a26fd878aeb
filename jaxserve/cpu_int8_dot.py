"""w8a8's int8 x int8 -> int32 dot on x86 CPUs with AVX-512 VNNI: cpu_int8_dot.cc, an XLA FFI
custom call, built on first use with the system's C++ compiler and registered with XLA CPU.

Why: XLA CPU hands an s8 x s8 dot to YNNPACK, which at a few rows multiplies at about half the
rate XLA's own f32 matrix-vector product streams its weight (benchmarks/results/quantization.md),
so int8 weights gained 1.4x at batch 1 where the bytes allow 4x. The kernel reads each weight
row once in its stored layout with VPDPBUSD: on the 2-core dev box it streams int8 weights at
about the f32 product's rate in bytes, i.e. 3-4x its rate in weights. Under tensor parallelism
(custom partitioning below) each device multiplies its own shard of the weight.

It is used for up to MAX_ROWS tokens (decode steps); more rows, CPUs without AVX-512 VNNI and
hosts without a C++ compiler keep XLA's dot (`available()` says which). The library is built
once per source, flags and jaxlib into CACHE_DIR, and registered as soon as this module is
imported when it is there already, so executables loaded from the store (executables.py) find
the target without tracing again.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("cpu_int8_dot.cc")
TARGET = "jaxserve_int8_dot"
MAX_ROWS = 16   # the kernel's kMaxRows: tokens whose accumulators stay in registers
CACHE_DIR = pathlib.Path(os.path.expanduser("~/.cache/jaxserve/kernels"))
CPU_FEATURES = ("avx512f", "avx512bw", "avx512_vnni")   # /proc/cpuinfo's names
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vnni"]


def _cpu_has_vnni() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return all(f in flags for f in CPU_FEATURES)


def _library_path() -> pathlib.Path:
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + jaxlib.__version__.encode())
    return CACHE_DIR / f"cpu_int8_dot-{key.hexdigest()[:16]}.so"


def _build(path: pathlib.Path) -> None:
    """Compiles into a temporary file, then renames it: concurrent builders each write a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([os.environ.get("CXX", "c++"), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp],
                       check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _register(path: pathlib.Path) -> None:
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxserveInt8Dot), platform="cpu")


@functools.cache
def available() -> bool:
    """Whether the kernel runs here: built (now, if it is not yet) and registered."""
    if not _cpu_has_vnni():
        return False
    path = _library_path()
    try:
        if not path.exists():
            _build(path)
        _register(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("w8a8 int8 dot kernel unavailable, using XLA's dot: %s", getattr(e, "stderr", None) or e)
        return False
    return True


def _call(xq, qweight):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((xq.shape[0], qweight.shape[0]), jnp.int32))(xq, qweight)


@custom_partitioning
def _sharded_call(xq, qweight):
    return _call(xq, qweight)


def _weight_axes(sharding) -> tuple:
    """The mesh axes (or None) of a weight's output and input dims."""
    spec = (*sharding.spec, None, None)
    return spec[0], spec[1]


def _infer_sharding(mesh, arg_shapes, result_shape):
    return NamedSharding(mesh, P(None, _weight_axes(arg_shapes[1].sharding)[0]))


def _partition(mesh, arg_shapes, result_shape):
    """Tensor parallelism: each device multiplies its shard of the weight. Split over outputs
    (q/k/v, gate, up, the head), its outputs come out split alike; split over inputs (o, down),
    x comes split alike and the int32 partial sums are added across devices (exactly)."""
    out_axis, in_axis = _weight_axes(arg_shapes[1].sharding)

    def local(xq, qweight):
        y = _call(xq, qweight)
        return y if in_axis is None else jax.lax.psum(y, in_axis)
    return (mesh, local, NamedSharding(mesh, P(None, out_axis)),
            (NamedSharding(mesh, P(None, in_axis)), NamedSharding(mesh, P(out_axis, in_axis))))


# Without this, XLA would gather a split weight whole onto every device before the custom call.
_sharded_call.def_partition(infer_sharding_from_operands=_infer_sharding, partition=_partition,
                            sharding_rule="rows inputs, outputs inputs -> rows outputs")


def dot(xq, qweight):
    """int32 xq @ qweight.T for int8 xq [..., in] (at most MAX_ROWS rows) and qweight [out, in]."""
    rows = xq.size // xq.shape[-1]
    y = _sharded_call(xq.reshape(rows, xq.shape[-1]), qweight)
    return y.reshape(*xq.shape[:-1], qweight.shape[0])


if _cpu_has_vnni() and _library_path().exists():
    available()
