"""Multi-host serving: one JAX process per host, one global mesh, one host loop.

Every process holds its own devices' slices of the weights and KV cache, and all of them must
launch the same jitted computations with the same host inputs, in the same order. Only
process 0 runs the engine (HTTP server, scheduler, block manager). Each step it packs the
step's host arrays into int32 blocks and broadcasts them (`Broadcaster.send`); the other
processes sit in `follow`, unpack each step and replay it.

An idle leader sends no steps, and a follower must not wait for the next one inside a device
collective: collectives give up after a while (CPU gloo after 30 s). So before idling the
leader sends an "idle" message, and the followers then wait on the coordination service's
key-value store (a host RPC with no deadline) for the key that wakes them.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxserve.config import DistributedConfig

HEADER_SIZE = 256     # int32s: array count (-1: idle), then (dtype code, ndim, *dims) per array
FIRST_SIZE = 4096     # int32s in a message's first broadcast: header + start of the payload
BLOCK_SIZE = 1 << 16  # int32s in each further broadcast (fixed sizes: two compilations in all)
IDLE = None           # the idle message (an empty list is the stop message)
WAKE_KEY = "jaxserve/wake/{}"
_DTYPES = (np.int32, np.float32, np.bool_, np.uint32)


def distributed_config(coordinator_address: str | None = None, num_processes: int | None = None,
                       process_id: int | None = None) -> DistributedConfig | None:
    """This process's multi-host settings: the given values, else the documented JAXSERVE_*
    variables, the rest from JAX's cluster detection (Cloud TPU pod slices, SLURM, Open MPI);
    None when there is one process. The launcher (jaxserve.cli) calls it once and passes the
    result on in EngineConfig.distributed: it must know the process id before the engine starts."""
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
             "process_id": process_id}
    for name, value in given.items():
        env = DistributedConfig.ENV[name]
        if value is None and os.environ.get(env):
            given[name] = os.environ[env]
    if None in given.values():
        from jax._src.clusters import ClusterEnv   # no public API for detection alone

        address, n, pid, _ = ClusterEnv.auto_detect_unset_distributed_params(
            given["coordinator_address"], given["num_processes"], given["process_id"], None, None, 300)
        if None in (address, n, pid):
            raise SystemExit("multi-host: no cluster detected; give --coordinator-address, --num-processes "
                             f"and --process-id (or {', '.join(DistributedConfig.ENV.values())})")
        given = {"coordinator_address": address, "num_processes": n, "process_id": pid}
    dist = DistributedConfig(str(given["coordinator_address"]), int(given["num_processes"]),
                             int(given["process_id"]))
    return dist if dist.num_processes > 1 else None


def initialize(dist: DistributedConfig) -> None:
    """jax.distributed.initialize for this process of a multi-host engine."""
    # JAX's preemption service (for training checkpoints) catches SIGTERM; the server handles
    # SIGTERM itself (drain, then exit), so it must reach the server.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(dist.coordinator_address, dist.num_processes, dist.process_id)


def is_leader() -> bool:
    return jax.process_index() == 0


def local_value(tree):
    """device_get of a tree of replicated arrays that may span other processes' devices
    (read from this process's first replica)."""
    def one(x):
        if x.is_fully_addressable:
            return x
        if not x.sharding.is_fully_replicated:
            raise ValueError(f"{x.sharding} is not replicated: no process holds all of it")
        return x.addressable_data(0)
    return jax.device_get(jax.tree.map(one, tree))


def _pack(arrays: list[np.ndarray] | None) -> np.ndarray:
    """One flat int32 buffer: the header, then every array's bytes."""
    header = np.zeros(HEADER_SIZE, np.int32)
    if arrays is IDLE:
        header[0] = -1
        return header
    fields, payload = [len(arrays)], []
    for a in arrays:
        a = np.asarray(a)
        code = next((i for i, t in enumerate(_DTYPES) if a.dtype == t), None)
        if code is None:
            raise TypeError(f"cannot broadcast dtype {a.dtype}; use one of {_DTYPES}")
        fields += [code, a.ndim, *a.shape]
        payload.append(a.astype(np.int32).ravel() if a.dtype == np.bool_
                       else np.ascontiguousarray(a).view(np.int32).ravel())
    if len(fields) > HEADER_SIZE:
        raise ValueError(f"{len(arrays)} arrays need a header of {len(fields)} > {HEADER_SIZE}")
    header[:len(fields)] = fields
    return np.concatenate([header, *payload])


def _layout(header: np.ndarray) -> list[tuple[type, tuple[int, ...]]]:
    out, pos = [], 1
    for _ in range(max(int(header[0]), 0)):
        ndim = int(header[pos + 1])
        out.append((_DTYPES[header[pos]], tuple(int(d) for d in header[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def _unpack(buf: np.ndarray) -> list[np.ndarray] | None:
    if buf[0] == -1:
        return IDLE
    out, off = [], HEADER_SIZE
    for dtype, shape in _layout(buf):
        n = int(np.prod(shape))
        chunk = buf[off:off + n]
        off += n
        out.append((chunk.astype(np.bool_) if dtype == np.bool_ else chunk.view(dtype)).reshape(shape))
    return out


def _broadcast_block(block: np.ndarray, size: int) -> np.ndarray:
    block = np.pad(block, (0, size - len(block)))
    return np.asarray(multihost_utils.broadcast_one_to_all(block, is_source=is_leader()))


def _broadcast(arrays: list[np.ndarray] | None) -> list[np.ndarray] | None:
    """Process 0's message (a list of arrays, or IDLE) on every process. The other processes'
    argument is ignored. Fixed-size blocks, so the broadcast compiles for two shapes only: the
    first block (header and, for a small message such as a decode step, all of it), then as many
    further blocks as the header says the payload needs."""
    leader = is_leader()
    buf = _pack(arrays) if leader else np.zeros(0, np.int32)
    first = _broadcast_block(buf[:FIRST_SIZE], FIRST_SIZE)
    total = HEADER_SIZE + sum(int(np.prod(shape)) for _, shape in _layout(first))
    blocks = [first] + [_broadcast_block(buf[start:start + BLOCK_SIZE], BLOCK_SIZE)
                        for start in range(FIRST_SIZE, total, BLOCK_SIZE)]
    return _unpack(np.concatenate(blocks)[:total])


def broadcast_arrays(arrays: list[np.ndarray] | None) -> list[np.ndarray]:
    """Process 0 passes the arrays (int32, float32, uint32 or bool), the others None; every
    process returns process 0's arrays."""
    if is_leader() and arrays is None:
        raise ValueError("process 0 must pass the arrays to broadcast")
    return _broadcast(arrays)


def warmup() -> None:
    """Compile both broadcast block shapes (every process, at the same point)."""
    _broadcast([np.zeros(FIRST_SIZE, np.int32)])


def _kv_client():
    from jax._src import distributed   # the coordination service's client (no public handle)
    return distributed.global_state.client


class Broadcaster:
    """Process 0's side: sends each step to the followers, parks them while idle, stops them."""

    def __init__(self):
        self.pauses = 0        # idle periods so far; followers wait on WAKE_KEY.format(pauses)
        self._awake = False   # followers start waiting (they are past warm-up before the leader)

    def send(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Broadcast a non-empty list of arrays; returns what every process received."""
        if not arrays:
            raise ValueError("an empty message is the stop message (use stop())")
        self._wake()
        return _broadcast(arrays)

    def pause(self) -> None:
        """Nothing to run for now: the followers go to wait on the key-value store."""
        if self._awake:
            _broadcast(IDLE)
            self._awake = False
            self.pauses += 1

    def stop(self) -> None:
        """End the followers' loop (`follow` returns)."""
        self._wake()
        _broadcast([])

    def _wake(self) -> None:
        if self._awake:
            return
        client = _kv_client()
        client.key_value_set(WAKE_KEY.format(self.pauses), "1")
        if self.pauses:   # every follower read the previous key: they all took the idle message since
            client.key_value_delete(WAKE_KEY.format(self.pauses - 1))
        self._awake = True


def _wait_for_key(key: str, poll_ms: int = 600_000) -> None:
    client = _kv_client()
    while True:
        try:
            client.blocking_key_value_get(key, poll_ms)
            return
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def follow(run_step: Callable[[list[np.ndarray]], object]) -> int:
    """The host loop of processes other than 0: replay each step process 0 sends, waiting on the
    key-value store while it idles, until it stops. Returns the number of steps run."""
    epoch = steps = 0
    while True:
        _wait_for_key(WAKE_KEY.format(epoch))
        epoch += 1
        while (arrays := _broadcast(None)) is not IDLE:
            if not arrays:
                return steps
            run_step(arrays)
            steps += 1
