"""Data parallelism within one process: independent engine replicas over the "data" mesh axis.

Each slice of the "data" axis gets its own LLMEngine on its own ("model" x "seq") sub-mesh:
its own copy of the weights, KV cache, scheduler and engine thread; replicas share nothing,
so no collective ever crosses the "data" axis. `DataParallelEngine` has the EngineThread
interface the server uses (start / submit / abort / shutdown / num_pending) and sends each
request to the replica with the fewest unfinished requests.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading

from jaxserve import parallel
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine import EngineThread, LLMEngine, RequestStream


class DataParallelEngine:
    def __init__(self, engine_cfg: EngineConfig, *, params=None, devices=None):
        mesh = parallel.make_mesh(engine_cfg.mesh, devices)
        replica_cfg = dataclasses.replace(engine_cfg, mesh={**engine_cfg.mesh, "data": 1})
        self.threads = [EngineThread(LLMEngine(replica_cfg, params=params, mesh=sub))
                        for sub in parallel.data_submeshes(mesh)]
        self.engine = self.threads[0].engine  # tokenizer, limits, validate: the same in every replica
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self, warmup: bool = True) -> "DataParallelEngine":
        for t in self.threads:
            t.start(warmup)
        return self

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """To the least-loaded replica (fewest submitted, unfinished requests; ties: lowest index)."""
        with self._lock:
            request_id = request_id or f"req-{next(self._ids)}"  # unique across replicas
            thread = min(self.threads, key=lambda t: t.num_pending)
            return thread.submit(prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        for t in self.threads:  # an unknown id is a no-op in a replica
            t.abort(request_id)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        for t in self.threads:
            t.shutdown(drain, timeout)

    @property
    def num_pending(self) -> int:
        return sum(t.num_pending for t in self.threads)
