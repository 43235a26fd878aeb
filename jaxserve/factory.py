"""Builds engines for a config: the one place that decides an engine's shape.

`build_client(cfg)` returns an EngineClient, what the server and the CLI drive:
  * one engine on a background thread (EngineThread), the usual case, and process 0 of a
    multi-host engine (one engine over all hosts' devices);
  * data-parallel replicas, one per slice of the mesh's "data" axis (DataParallelEngine);
  * a multi-host follower, any process but 0 (Follower): the same engine and warm-up as
    process 0's, then it replays process 0's steps.
`build_engine(cfg)` returns one LLMEngine for callers that step it themselves (jaxserve.LLM).
Everything comes from the EngineConfig, multi-host settings included (cfg.distributed):
nothing is read from the environment here.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Protocol

from jaxserve.config import EngineConfig

from jaxserve.engine import LLMEngine
from jaxserve.engine_thread import EngineStoppedError, EngineThread, RequestStream
from jaxserve.sampling_params import SamplingParams


class EngineClient(Protocol):
    """What the server and the CLI drive, whatever the engine's shape."""
    engine: LLMEngine            # the first replica: tokenizer, model config, limits
    engines: list[LLMEngine]     # every replica in this process (metrics)
    step_listeners: list         # called with (RequestOutput list, step seconds) after each step

    def start(self, warmup: bool = True) -> "EngineClient":
        """Warm up, then run (an EngineThread serves once what serves every request is built, and
        builds the other step shapes in the background: jaxserve/warmup.py)."""

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Check the request (raises InvalidRequest, a ValueError) and queue it (raises
        QueueFullError, EngineStoppedError); iterate the stream for its outputs."""

    def abort(self, request_id: str) -> None: ...

    def when_idle(self, fn, timeout: float | None = None):
        """fn(engine) on every replica once its requests in flight have finished, holding the
        ones submitted meanwhile (EngineThread.when_idle); the first replica's result."""

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain, finish what was accepted first."""

    @property
    def num_pending(self) -> int:
        """Requests submitted and not finished."""

    @property
    def lost(self) -> Exception | None:
        """Why the engine was given up for lost (failed steps in a row), or None."""


class Follower:
    """A multi-host process other than 0. It serves no requests: once warm it replays process
    0's steps on a background thread until process 0 stops; `shutdown(drain=True)` waits
    for that."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.engines = [engine]
        self.step_listeners = []   # never called: the steps are process 0's
        self.steps = 0   # steps replayed, once process 0 stopped
        self._thread = threading.Thread(target=self._follow, name="jaxserve-follower", daemon=True)

    def start(self, warmup: bool = True) -> "Follower":
        if warmup:
            self.engine.warmup()
        self._thread.start()
        return self

    def _follow(self) -> None:
        self.steps = self.engine.runner.follow()

    def submit(self, prompt_token_ids, params, request_id=None) -> RequestStream:
        raise EngineStoppedError("this process follows process 0 of a multi-host engine: send requests there")

    def abort(self, request_id: str) -> None:
        pass   # it holds no requests

    def when_idle(self, fn, timeout: float | None = None):
        raise EngineStoppedError("this process follows process 0 of a multi-host engine")

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        if drain:
            self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        return 0

    lost = None   # process 0 decides; a follower stops with it


def build_engine(cfg: EngineConfig) -> LLMEngine:
    """One engine (one replica). A multi-host process joins the other processes first: its mesh
    spans every process's devices."""
    if cfg.mesh.get("data", 1) > 1:
        raise ValueError("one engine is one replica: data-parallel replicas (mesh data > 1) come from "
                         "build_client")
    if cfg.distributed is not None:
        from jaxserve import multihost

        multihost.initialize(cfg.distributed)
    return LLMEngine(cfg)


def build_client(cfg: EngineConfig) -> EngineClient:
    """The EngineClient for `cfg`, not yet started."""
    if cfg.mesh.get("data", 1) == 1:
        engine = build_engine(cfg)
        if cfg.distributed is not None and not cfg.distributed.is_leader:
            return Follower(engine)
        return EngineThread(engine)
    from jaxserve import parallel
    from jaxserve.data_parallel import DataParallelEngine

    replica = dataclasses.replace(cfg, mesh={**cfg.mesh, "data": 1})
    return DataParallelEngine([EngineThread(LLMEngine(replica, mesh=sub))
                               for sub in parallel.data_submeshes(parallel.make_mesh(cfg.mesh))])
