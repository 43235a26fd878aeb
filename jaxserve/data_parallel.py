"""Data parallelism within one process: independent engine replicas over the "data" mesh axis.

Each slice of the "data" axis gets its own LLMEngine on its own ("model" x "seq") sub-mesh
(built by jaxserve.factory): its own copy of the weights, KV cache, scheduler and engine
thread; replicas share nothing, so no collective ever crosses the "data" axis.
`DataParallelEngine` is an EngineClient like EngineThread. It sends each request to the replica
whose prefix cache holds the longest start of its prompt (a conversation's next turn, a beam-search
round, a shared system prompt: computed once, where it is cached), unless that replica has
max_num_seqs more unfinished requests than the least loaded one; without a hit, to the least
loaded (fewest unfinished requests; ties: the lowest index).
"""
from __future__ import annotations

import itertools
import threading

from jaxserve import lora
from jaxserve.engine_thread import EngineThread, RequestStream
from jaxserve.sampling_params import InvalidRequest, SamplingParams


class DataParallelEngine:
    def __init__(self, threads: list[EngineThread]):
        self.threads = threads
        self.engines = [t.engine for t in threads]
        self.engine = self.engines[0]   # tokenizer and limits: the same in every replica
        # MBU / MFU gauges follow the first replica (every replica has the same devices' share).
        self.step_listeners = threads[0].step_listeners
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def start(self, warmup: bool = True) -> "DataParallelEngine":
        for t in self.threads:
            t.start(warmup)
        return self

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """To the replica the module docstring says."""
        with self._lock:
            request_id = request_id or f"req-{next(self._ids)}"  # unique across replicas
            least = min(t.num_pending for t in self.threads)
            slack = self.engine.ecfg.max_num_seqs
            thread = max((t for t in self.threads if t.num_pending <= least + slack),
                         key=lambda t: (cached_tokens(t.engine, prompt_token_ids, params), -t.num_pending))
            return thread.submit(prompt_token_ids, params, request_id)

    def abort(self, request_id: str) -> None:
        for t in self.threads:  # an unknown id is a no-op in a replica
            t.abort(request_id)

    def when_idle(self, fn, timeout: float | None = None):
        return [t.when_idle(fn, timeout) for t in self.threads][0]   # one replica at a time: the others serve

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        for t in self.threads:
            t.shutdown(drain, timeout)

    @property
    def num_pending(self) -> int:
        return sum(t.num_pending for t in self.threads)

    @property
    def lost(self):
        """Why a replica was given up for lost (the process should restart), or None."""
        return next((t.lost for t in self.threads if t.lost is not None), None)


def cached_tokens(engine, prompt_token_ids: list[int], params: SamplingParams) -> int:
    """How much of the prompt the engine's prefix cache holds (read from another thread: a stale
    answer only routes less well); 0 for a request the engine will refuse."""
    try:
        adapter = lora.resolve(engine.loras, params.lora_name)
    except InvalidRequest:
        return 0
    return engine.block_manager.match_prefix(prompt_token_ids, params.cache_salt,
                                             adapter and adapter.id).num_tokens
