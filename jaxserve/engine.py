"""LLMEngine (add / abort / step), the background engine thread with per-request streams, and
the offline `LLM` API.

The engine owns the scheduler (what runs), the runner (how it runs) and the detokenizers; it
turns each step's sampled tokens into text deltas, applies stop conditions and frees pages.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import parallel
from jaxserve.checkpoint import load_params, param_shapes
from jaxserve.config import EngineConfig, ModelConfig, SamplingParams
from jaxserve.kv_cache import BlockManager
from jaxserve.runner import ModelRunner, SampleResult
from jaxserve.scheduler import Scheduler
from jaxserve.sequence import Sequence
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

log = logging.getLogger(__name__)

TINY_MODEL_DIR = os.path.join(os.path.dirname(__file__), "assets", "tiny")


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and accepts no new requests (HTTP 503)."""


@dataclasses.dataclass
class CompletionOutput:
    """One choice. In a stream, text/token_ids/logprobs are the new part; `finish_reason` is set
    on the choice's last output."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampleResult] | None = None
    finish_reason: str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_generated_tokens: int = 0      # over all choices, so far
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_time: float | None = None


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer]
    texts: list[str]                    # full text of each choice so far (stop-string search)
    emitted: list[int]                  # characters of each choice's text already sent
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_generated: int = 0


class LLMEngine:
    def __init__(self, engine_cfg: EngineConfig | None = None, *, params=None, mesh=None):
        self.ecfg = engine_cfg or EngineConfig()
        _enable_compilation_cache(self.ecfg.compilation_cache_dir)
        model_dir = self.ecfg.model or TINY_MODEL_DIR
        self.model_dir = model_dir
        self.model_cfg = ModelConfig.from_pretrained(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.dtype = _resolve_dtype(self.ecfg.dtype)
        mesh = mesh if mesh is not None else parallel.make_mesh(self.ecfg.mesh)
        if params is None:  # each device reads only its own slice of every weight
            shardings = parallel.param_shardings(param_shapes(self.model_cfg, self.dtype), mesh, self.model_cfg)
            params = load_params(model_dir, self.model_cfg, self.dtype, shardings=shardings)
        self.runner = ModelRunner(self.model_cfg, params, self.ecfg, mesh=mesh, dtype=self.dtype)
        self.max_model_len = self.runner.max_model_len
        self.block_manager = BlockManager(self.runner.num_pages, self.ecfg.page_size,
                                          self.ecfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.ecfg, self.block_manager)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_cfg.eos_token_ids)
        self._requests: dict[str, _Request] = {}
        self._seeds: dict[int, int] = {}
        self._rng = np.random.default_rng(self.ecfg.seed)
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "requests_finished": 0}
        self.last_schedule = None   # the SchedulerOutput of the latest step (roofline accounting)

    def warmup(self) -> int:
        return self.runner.warmup()

    # ---- requests ----
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError on anything the engine cannot serve."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.model_cfg.vocab_size}): {bad[:5]}")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {len(prompt_token_ids)} tokens and max_tokens is "
                             f"{params.max_tokens} ({total} in total)")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        self.validate(prompt_token_ids, params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=params,
                         arrival_time=arrival, index=i) for i in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)
            # Choices of one seeded request differ from each other but repeat run to run.
            self._seeds[seq.seq_id] = (params.seed + seq.index if params.seed is not None
                                       else int(self._rng.integers(2**31)))
        self._requests[request_id] = _Request(
            request_id, list(prompt_token_ids), params, seqs,
            [IncrementalDetokenizer(self.tokenizer, prompt_token_ids) for _ in seqs],
            [""] * len(seqs), [0] * len(seqs), arrival)
        self.stats["prompt_tokens"] += len(prompt_token_ids)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort(request_id)
        for seq in req.seqs:
            self._seeds.pop(seq.seq_id, None)
        return self._output(req, [CompletionOutput(s.index, "", [], None, "abort") for s in req.seqs],
                            finished=True)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        out = self.last_schedule = self.scheduler.schedule()
        if not out.scheduled and not out.page_copies:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            req = self._requests[s.seq.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        results = self.runner.execute(out, self._seeds)
        self.scheduler.postprocess(out, {k: r.token for k, r in results.items()})
        self.stats["steps"] += 1
        now = time.monotonic()
        deltas: dict[str, list[CompletionOutput]] = {}
        for s in out.scheduled:
            if s.seq.seq_id not in results:
                continue
            seq, res = s.seq, results[s.seq.seq_id]
            req = self._requests[seq.request_id]
            req.num_generated += 1
            self.stats["generation_tokens"] += 1
            if req.first_token_time is None:
                req.first_token_time = now
            deltas.setdefault(seq.request_id, []).append(self._advance(req, seq, res))
        outputs = []
        for request_id, choice_outputs in deltas.items():
            req = self._requests[request_id]
            finished = all(seq.is_finished for seq in req.seqs)
            outputs.append(self._output(req, choice_outputs, finished))
            if finished:
                del self._requests[request_id]
                for seq in req.seqs:
                    self._seeds.pop(seq.seq_id, None)
                self.stats["requests_finished"] += 1
        return outputs

    def _advance(self, req: _Request, seq: Sequence, res: SampleResult) -> CompletionOutput:
        """Detokenize the new token, apply stop conditions, return the choice's delta."""
        p, i, token = req.params, seq.index, res.token
        reason = None
        is_stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        if is_stop_token:
            reason = "stop"
        else:
            req.texts[i] += req.detoks[i].step([token])
        if reason is None and p.stop:
            # Search only where a new match can start.
            start = max(0, req.emitted[i] - max(map(len, p.stop)))
            hits = [(req.texts[i].find(s, start), s) for s in p.stop]
            hits = [(pos, s) for pos, s in hits if pos >= 0]
            if hits:
                req.texts[i] = req.texts[i][:min(hits)[0]]
                reason = "stop"
        if reason is None and (len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if reason == "length":
                req.texts[i] += req.detoks[i].flush()
            self.scheduler.finish(seq, reason)
            hold = 0
        else:
            hold = max(map(len, p.stop), default=1) - 1  # a stop string may still be completing
        end = max(req.emitted[i], len(req.texts[i]) - hold)
        text = req.texts[i][req.emitted[i]:end]
        req.emitted[i] = end
        token_ids = [] if is_stop_token else [token]
        return CompletionOutput(i, text, token_ids, [res] if p.logprobs is not None else None, reason)

    def _output(self, req: _Request, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            req.request_id, req.prompt_token_ids, outputs, finished, req.num_generated,
            req.arrival_time, req.first_token_time, time.monotonic() if finished else None,
            req.first_scheduled_time)


def _resolve_dtype(name: str):
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _enable_compilation_cache(path: str | None) -> None:
    if path:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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

    def outputs(self, alive: Callable[[], bool] | None = None,
                poll_s: float = 0.25) -> Iterator[RequestOutput]:
        """The deltas until the finished one. With `alive`, ask it every `poll_s` seconds
        while waiting and stop early when it says no (the caller then aborts)."""
        next_check = time.monotonic() + poll_s
        while True:
            try:
                item = self._queue.get(timeout=poll_s if alive else None)
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
    """Runs LLMEngine.step in a background thread; thread-safe submit / abort / shutdown."""

    def __init__(self, engine: LLMEngine, max_queue_size: int | None = None):
        self.engine = engine
        self.max_queue_size = max_queue_size or engine.ecfg.max_queue_size
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._accepting = True
        self._stop = False
        self._lock = threading.Lock()
        self._pending = 0   # submitted, not yet finished
        self._ids = itertools.count()
        self.ready = threading.Event()
        self.step_listeners = []   # called with (RequestOutput list, step seconds) after each step
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)

    def start(self, warmup: bool = True) -> "EngineThread":
        if warmup:
            self.engine.warmup()
        self.ready.set()
        self._thread.start()
        return self

    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               request_id: str | None = None) -> RequestStream:
        """Validate and enqueue. Raises ValueError (bad input), QueueFullError, EngineStoppedError."""
        self.engine.validate(prompt_token_ids, params)
        with self._lock:
            if not self._accepting:
                raise EngineStoppedError("the server is shutting down")
            # Counted from the requests in flight, not the scheduler's waiting list: the engine
            # thread admits with a lag, and a burst must not see slots it has not reached yet.
            if self._pending >= self.engine.ecfg.max_num_seqs + self.max_queue_size:
                raise QueueFullError(f"the waiting queue is full ({self.max_queue_size} requests beyond "
                                     f"the {self.engine.ecfg.max_num_seqs} running)")
            request_id = request_id or f"req-{next(self._ids)}"
            stream = RequestStream(request_id, self)
            self._streams[request_id] = stream
            self._pending += 1
        self._inbox.put(("add", request_id, prompt_token_ids, params, time.monotonic()))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

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

    @property
    def num_pending(self) -> int:
        return self._pending

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self.engine.runner.pause_followers()   # multi-host: park the other processes
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:  # never leave clients hanging on a dead engine
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            dt = time.monotonic() - t0
            for out in outputs:
                self._deliver(out)
            for listener in self.step_listeners:
                listener(outputs, dt)
        self.engine.runner.stop_followers()

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, request_id, prompt, params, arrival = msg
                if request_id not in self._streams:   # aborted before it was added
                    continue
                try:
                    self.engine.add_request(prompt, params, request_id, arrival)
                except ValueError as e:
                    self._finish_stream(request_id, e)
            else:
                out = self.engine.abort(msg[1])
                if out is not None:
                    self._deliver(out)
                elif msg[1] in self._streams:       # still in the inbox: drop it there
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

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._finish_stream(request_id, RuntimeError(f"engine failure: {error}"))


class LLM:
    """Offline batch generation: `LLM(model=dir).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Final outputs in prompt order (each choice's full text and token ids)."""
        from tqdm import tqdm

        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        order = {}
        for i, (p, sp) in enumerate(zip(ids, params)):
            order[self.engine.add_request(p, sp)] = i
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    final = results.setdefault(out.request_id, RequestOutput(
                        out.request_id, out.prompt_token_ids,
                        [CompletionOutput(i, "", []) for i in range(params[order[out.request_id]].n)]))
                    for c in out.outputs:
                        acc = final.outputs[c.index]
                        acc.text += c.text
                        acc.token_ids += c.token_ids
                        if c.logprobs:
                            acc.logprobs = (acc.logprobs or []) + c.logprobs
                        acc.finish_reason = c.finish_reason or acc.finish_reason
                    final.finished = out.finished
                    if out.finished:
                        final.arrival_time, final.first_token_time = out.arrival_time, out.first_token_time
                        final.finish_time = out.finish_time
                        bar.update(1)
        return [results[rid] for rid, _ in sorted(order.items(), key=lambda kv: kv[1])]
