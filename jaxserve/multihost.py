"""Multi-host serving: one JAX process per host, one global mesh, one host loop.

Every process holds its own devices' slices of the weights and KV cache, and all of them must
launch the same jitted step with the same host inputs, in the same order. Only process 0 runs
the engine (HTTP server, scheduler, block manager). Each step it packs the step's host arrays
into int32 buffers and broadcasts them (`broadcast_arrays`); the other processes sit in
`follow`, unpack each step and run it. An empty list ends the followers' loop.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV = {
    "coordinator_address": "JAXSERVE_COORDINATOR_ADDRESS",  # host:port of process 0
    "num_processes": "JAXSERVE_NUM_PROCESSES",
    "process_id": "JAXSERVE_PROCESS_ID",
}
HEADER_SIZE = 256  # int32s: array count, then (dtype code, ndim, *dims) per array
_DTYPES = (np.int32, np.float32, np.bool_, np.uint32)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """jax.distributed.initialize from the arguments, else the JAXSERVE_* environment
    variables. With neither, JAX detects the cluster itself (Cloud TPU pod slices, SLURM,
    Open MPI), so on a TPU slice `initialize()` on every host is enough."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    kwargs = {}
    for name, value in given.items():
        if value is None and os.environ.get(ENV[name]):
            value = os.environ[ENV[name]]
        if value is not None:
            kwargs[name] = value if name == "coordinator_address" else int(value)
    jax.distributed.initialize(**kwargs)


def is_leader() -> bool:
    return jax.process_index() == 0


def _pack(arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    header = [len(arrays)]
    payload = []
    for a in arrays:
        a = np.asarray(a)
        code = next((i for i, t in enumerate(_DTYPES) if a.dtype == t), None)
        if code is None:
            raise TypeError(f"cannot broadcast dtype {a.dtype}; use one of {_DTYPES}")
        header += [code, a.ndim, *a.shape]
        payload.append(a.astype(np.int32).ravel() if a.dtype == np.bool_
                       else np.ascontiguousarray(a).view(np.int32).ravel())
    if len(header) > HEADER_SIZE:
        raise ValueError(f"{len(arrays)} arrays need a header of {len(header)} > {HEADER_SIZE}")
    packed_header = np.zeros(HEADER_SIZE, np.int32)
    packed_header[:len(header)] = header
    return packed_header, np.concatenate(payload or [np.zeros(0, np.int32)])


def _layout(header: np.ndarray) -> list[tuple[type, tuple[int, ...]]]:
    out, pos = [], 1
    for _ in range(int(header[0])):
        ndim = int(header[pos + 1])
        out.append((_DTYPES[header[pos]], tuple(int(d) for d in header[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def _unpack(header: np.ndarray, payload: np.ndarray) -> list[np.ndarray]:
    out, off = [], 0
    for dtype, shape in _layout(header):
        n = int(np.prod(shape))
        chunk = payload[off:off + n]
        off += n
        out.append((chunk.astype(np.bool_) if dtype == np.bool_ else chunk.view(dtype)).reshape(shape))
    return out


def broadcast_arrays(arrays: list[np.ndarray] | None) -> list[np.ndarray]:
    """Process 0 passes the step's arrays (int32, float32, uint32 or bool), the others None;
    every process returns process 0's arrays. Two broadcasts: the fixed-size header (shapes),
    then the payload, whose size the header gives."""
    leader = is_leader()
    if leader and arrays is None:
        raise ValueError("process 0 must pass the arrays to broadcast")
    header, payload = _pack(arrays) if leader else (np.zeros(HEADER_SIZE, np.int32), None)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header, is_source=leader))
    if not leader:
        payload = np.zeros(sum(int(np.prod(shape)) for _, shape in _layout(header)), np.int32)
    if payload.size:
        payload = np.asarray(multihost_utils.broadcast_one_to_all(payload, is_source=leader))
    return _unpack(header, payload)


def follow(run_step: Callable[[list[np.ndarray]], None]) -> None:
    """The host loop of processes other than 0: run each broadcast step until an empty one."""
    while arrays := broadcast_arrays(None):
        run_step(arrays)
