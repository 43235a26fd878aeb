"""The engine on a background thread: thread-safe submit / abort / shutdown, one RequestStream
per request, and a bounded queue (QueueFullError past it) for the server and other callers that
do not step the engine themselves.

`call_when_idle(fn)` runs fn(engine) on the engine thread once no request is in flight, holding
the requests submitted after it until it returns (new weights: jaxserve/weight_update.py), and
while the engine sleeps (jaxserve/sleep_mode.py: a request that passed its check as the engine
went to sleep runs once it wakes).

A failed step fails the requests it ran (their streams raise RequestFailed; their pages are
freed) and the engine goes on. After `max_failed_steps` failed steps in a row the device is
taken for lost: every request fails, `lost` says why, the loop stops and submit refuses.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from typing import Callable, Iterator

from jaxserve.engine import LLMEngine, Request, RequestOutput, StepError
from jaxserve.sampling_params import InvalidRequest, SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine failed this request: a step it was in raised (HTTP 500)."""


class DeadlineExceeded(TimeoutError):
    """The request's deadline passed before it finished (HTTP 408)."""


class RequestStream:
    """The frontend's handle on one request: iterate it for RequestOutput deltas."""

    def __init__(self, request_id: str, engine: "EngineThread"):
        self.request_id = request_id
        self._engine = engine
        self._queue: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        self._queue.put(item)

    def __iter__(self) -> Iterator[RequestOutput]:
        return self.outputs()

    def outputs(self, alive: Callable[[], bool] | None = None, deadline: float | None = None,
                poll_s: float = 0.25) -> Iterator[RequestOutput]:
        """The deltas until the finished one. With `alive`, ask it every `poll_s` seconds
        while waiting and stop early when it says no; past `deadline` (time.monotonic()), raise
        DeadlineExceeded. Either way the caller then aborts."""
        next_check = time.monotonic() + poll_s
        while True:
            wait = poll_s if alive else None
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded()
                wait = left if wait is None else min(wait, left)
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if alive is not None and time.monotonic() >= next_check:
                if not alive():
                    return
                next_check = time.monotonic() + poll_s
            if item is None:
                continue
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def abort(self) -> None:
        self._engine.abort(self.request_id)


class EngineThread:
    """Runs LLMEngine.step in a background thread; thread-safe submit / abort / shutdown.
    An EngineClient (jaxserve.factory): the server's engine when there is one replica."""

    def __init__(self, engine: LLMEngine, max_queue_size: int | None = None):
        self.engine = engine
        self.engines = [engine]
        self.max_queue_size = engine.ecfg.max_queue_size if max_queue_size is None else max_queue_size
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._accepting = True
        self._stop = False
        self._lock = threading.Lock()
        self._pending = 0   # submitted, not yet finished
        self._failed_steps = 0   # in a row
        self.lost: StepError | None = None   # set when the engine is given up for lost
        self.step_listeners = []   # called with (RequestOutput list, step seconds) after each step
        self._idle_calls: list[tuple[Callable, concurrent.futures.Future]] = []   # waiting for no request in flight
        self._held: list[Request] = []   # submitted while an idle call waits: added after it
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)

    def start(self, warmup: bool = True) -> "EngineThread":
        """Warm up what serves every request, then serve (the other step shapes are built in the
        background meanwhile: jaxserve/warmup.py)."""
        if warmup:
            self.engine.warmup(background=True)
        self._thread.start()
        return self

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Check (the request's one check) and enqueue. Raises InvalidRequest (a ValueError: bad
        input), QueueFullError, EngineStoppedError."""
        req = self.engine.new_request(prompt_token_ids, params, request_id)
        with self._lock:
            if self.lost is not None:
                raise EngineStoppedError(f"the engine is lost: {self.lost}")
            if not self._accepting:
                raise EngineStoppedError("the server is shutting down")
            # Counted from the requests in flight, not the scheduler's waiting list: the engine
            # thread admits with a lag, and a burst must not see slots it has not reached yet.
            if self._pending >= self.engine.ecfg.max_num_seqs + self.max_queue_size:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue_size} requests beyond "
                                     f"the {self.engine.ecfg.max_num_seqs} running)")
            if req.request_id in self._streams:
                raise InvalidRequest(f"duplicate request id {req.request_id!r}")
            stream = RequestStream(req.request_id, self)
            self._streams[req.request_id] = stream
            self._pending += 1
        self._inbox.put(("add", req))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def call_when_idle(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread once the requests submitted before this call have
        finished; the ones submitted after it wait until it returns. Its result (or exception)."""
        if self._stop:
            raise EngineStoppedError("the engine has stopped")
        done = concurrent.futures.Future()
        self._inbox.put(("idle", fn, done))
        self._wake.set()
        return done

    def when_idle(self, fn: Callable[[LLMEngine], object], timeout: float | None = None):
        return self.call_when_idle(fn).result(timeout)

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with drain, finish what was accepted first."""
        with self._lock:
            self._accepting = False
        if drain:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._pending and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.01)
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.engine.runner.stop_warmup()

    @property
    def num_pending(self) -> int:
        return self._pending

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if self._idle_calls and not self.engine.has_unfinished():
                self._run_idle_calls()
                continue
            if not self.engine.has_unfinished():
                self.engine.runner.pause_followers()   # multi-host: park the other processes
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                outputs = self.engine.step()
            except StepError as e:
                self._step_failed(e)
                continue
            except Exception as e:   # outside a step (scheduling): whose requests is unknown
                self._step_failed(StepError(list(self._streams), e))
                continue
            dt = time.monotonic() - t0
            if self._failed_steps:
                log.info("engine step succeeded after %d failed step(s)", self._failed_steps)
                self._failed_steps = 0
            for out in outputs:
                self._deliver(out)
            for listener in self.step_listeners:
                listener(outputs, dt)
        self.engine.runner.stop_followers()
        for _, done in self._idle_calls:
            done.set_exception(EngineStoppedError("the engine stopped before it was idle"))

    def _run_idle_calls(self) -> None:
        for fn, done in self._idle_calls:
            try:
                done.set_result(fn(self.engine))
            except Exception as e:
                done.set_exception(e)
        self._idle_calls.clear()
        if self.engine.sleeping:
            return
        for req in self._held:
            if req.request_id in self._streams:   # else aborted while held
                self.engine.add(req)
        self._held.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "idle":
                self._idle_calls.append(msg[1:])
            elif msg[0] == "add":
                req: Request = msg[1]
                if self._idle_calls or self.engine.sleeping:
                    self._held.append(req)
                elif req.request_id in self._streams:   # else aborted before it was added
                    self.engine.add(req)
            else:
                out = self.engine.abort(msg[1])
                if out is not None:
                    self._deliver(out)
                elif msg[1] in self._streams:       # still in the inbox or held: drop it there
                    self._finish_stream(msg[1], None)

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is not None:
            stream.put(out)
        if out.finished:
            self._finish_stream(out.request_id, None, notify=False)

    def _finish_stream(self, request_id: str, error: BaseException | None, notify: bool = True) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._pending -= 1
        if stream is not None and notify:
            stream.put(error if error is not None else RequestOutput(request_id, [], [], finished=True))

    def _step_failed(self, error: StepError) -> None:
        """Fail the step's requests (aborting frees their pages); after max_failed_steps in a
        row, every request, and stop. Logged on the first failure of a run and when lost."""
        self._failed_steps += 1
        if self._failed_steps == 1:
            log.error("engine step failed; failing its %d request(s)", len(error.request_ids),
                      exc_info=error.__cause__ or error)
        lost = self._failed_steps >= self.engine.ecfg.max_failed_steps
        if lost:
            log.critical("engine lost: %d steps failed in a row (last: %s); failing all %d request(s)",
                         self._failed_steps, error, len(self._streams))
            with self._lock:
                self.lost = error
        for request_id in list(self._streams) if lost else error.request_ids:
            self.engine.abort(request_id)
            self._finish_stream(request_id, RequestFailed(f"the engine failed while running this request ({error})"))
        if lost:
            self._stop = True


