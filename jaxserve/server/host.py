"""The frontend's handle on the engine: loads and warms it in the background (requests get 503
until it is ready), submits requests (engine refusals become HTTP errors), follows their deltas
(metrics, one log line per request, abort when the consumer goes away or its deadline passes)
and drains on shutdown."""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import threading
import time
from typing import Callable, Iterator

from jaxserve.config import EngineConfig

from jaxserve.metrics import Metrics
from jaxserve.sampling_params import InvalidRequest, SamplingParams, sampling_defaults
from jaxserve.server.errors import APIError

log = logging.getLogger("jaxserve.server")


class EngineHost:
    def __init__(self, engine_cfg: EngineConfig, model_name: str,
                 on_load_error: Callable[[], None] | None = None):
        self.engine_cfg = engine_cfg
        self.model_name = model_name
        self.created = int(time.time())
        # OpenAI's `system_fingerprint`: names the software version and engine settings that
        # produced a response (a change of either may change outputs for equal seeds).
        setup = json.dumps([version(), model_name, dataclasses.asdict(engine_cfg)], sort_keys=True, default=str)
        self.system_fingerprint = "fp_" + hashlib.sha256(setup.encode()).hexdigest()[:12]
        self.metrics = Metrics()
        self.engine_thread = None          # the EngineClient (jaxserve.factory) once warm
        # LoRA adapters served by name -> directory: lora_modules, then /v1/load_lora_adapter's. Replaced, never
        # edited, so a route reads a consistent dict while another loads.
        self.lora_modules = dict(engine_cfg.lora_modules)
        self._lora_lock = threading.Lock()   # one load or unload at a time
        self.load_error: Exception | None = None
        self.draining = False
        self._on_load_error = on_load_error
        threading.Thread(target=self._load, name="jaxserve-load", daemon=True).start()

    def _load(self) -> None:
        try:
            from jaxserve import factory   # JAX starts here, in the serving process
            from jaxserve.roofline import RooflineMeter, device_peaks

            t0 = time.monotonic()
            client = factory.build_client(self.engine_cfg)
            defaults = sampling_defaults(client.engine.model_dir, self.engine_cfg.generation_config)
            if defaults:   # (a bad generation_config.json fails here)
                log.info("request defaults from the model's generation_config.json: %s", defaults)
            # Warm-up before anything else: multi-host followers warm up at the same time.
            client.start(warmup=True)
            self.metrics.engines = client.engines
            self.engine_thread = client
            log.info("ready: %s (max_model_len %d, %d KV pages, %d replica(s)) after %.1fs", self.model_name,
                     client.engine.max_model_len, client.engine.block_manager.num_pages, len(client.engines),
                     time.monotonic() - t0)
            # The roofline gauges' peaks (measured on a CPU: seconds) after start-up, once warm-up
            # has finished in the background: its compilations would share the cores.
            for engine in client.engines:
                engine.runner.wait_warm()
            self.metrics.roofline = RooflineMeter(client.engine, device_peaks())
            client.step_listeners.append(self.metrics.roofline.on_step)
        except Exception as e:
            log.exception("the engine failed to load")
            self.load_error = e
            if self._on_load_error is not None:
                self._on_load_error()

    def require_engine(self):
        """The EngineClient, or 503 while warming up / shutting down."""
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine_lost is not None:
            raise APIError(503, f"the engine is lost ({self.engine_lost}); the server is restarting")
        if self.engine_thread is None:
            if self.load_error is not None:
                raise APIError(503, f"the engine failed to load: {self.load_error}")
            raise APIError(503, "the engine is warming up")
        return self.engine_thread

    @property
    def engine_lost(self) -> Exception | None:
        return None if self.engine_thread is None else self.engine_thread.lost

    def submit(self, prompts: list[list[int]], params: SamplingParams, request_id: str) -> list:
        """Submit each prompt as `{request_id}-{i}` (the engine checks each one); all or nothing:
        a refusal aborts the prompts submitted before it."""
        from jaxserve.engine_thread import EngineStoppedError, QueueFullError
        from jaxserve.sleep_mode import EngineAsleep

        client = self.require_engine()
        streams = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(client.submit(ids, params, f"{request_id}-{i}"))
        except (InvalidRequest, QueueFullError, EngineStoppedError, EngineAsleep) as e:
            for s in streams:
                s.abort()
            if isinstance(e, InvalidRequest):
                raise APIError(400, str(e), param=e.param) from None
            raise APIError(429 if isinstance(e, QueueFullError) else 503, str(e)) from None
        return streams

    def follow(self, streams: list, alive: Callable[[], bool] | None = None,
               timeout: float | None = None) -> Iterator[tuple[int, object]]:
        """(prompt index, RequestOutput delta) for each stream in turn (all run concurrently in the
        engine). Closing this generator early aborts the unfinished requests, freeing their pages;
        so does `alive` answering no while it waits (a client that left). Raises APIError 500 when
        the engine fails a request, 408 past the deadline (the smaller of `timeout` and the
        server's request_timeout_s, in seconds from now)."""
        limits = [t for t in (timeout, self.engine_cfg.request_timeout_s) if t is not None]
        deadline = time.monotonic() + min(limits) if limits else None
        finished = set()
        try:
            for i, stream in enumerate(streams):
                last = None
                for out in _outputs(stream, alive, deadline, min(limits, default=None)):
                    # Token gaps as the frontend sees them, from the first stream only: later
                    # ones have been buffering meanwhile.
                    if i == 0 and any(c.token_ids for c in out.outputs):
                        now = time.monotonic()
                        if last is not None:
                            self.metrics.inter_token.observe(now - last)
                        last = now
                    if out.finished:
                        finished.add(i)
                        self.metrics.observe_finished(out)
                        _log_finished(out)
                    yield i, out
        finally:
            for i, stream in enumerate(streams):
                if i not in finished:   # logged first: once aborted, the engine shows it at once
                    log.info("%s aborted (client gone, error or timeout)", stream.request_id)
                    stream.abort()

    def load_lora(self, name: str, path: str) -> None:
        """Serve adapter `name` from PEFT directory `path` (read and checked once, for every
        replica): 400 for a name in use or an adapter the engine cannot serve."""
        engines = self.require_engine().engines
        if engines[0].loras is None:
            raise APIError(400, "LoRA is not enabled: start the server with --enable-lora", param="lora_name")
        with self._lora_lock:
            if name == self.model_name or name in self.lora_modules:
                raise APIError(400, f"the LoRA adapter {name!r} has already been loaded", param="lora_name")
            try:
                adapter = engines[0].loras.read(name, path)
            except ValueError as e:
                raise APIError(400, str(e), param="lora_path") from None
            for engine in engines:
                engine.loras.add(adapter)
            self.lora_modules = {**self.lora_modules, name: path}
        log.info("loaded LoRA adapter %s from %s", name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (404 if not served); its requests in the engine run on."""
        engines = self.require_engine().engines
        with self._lora_lock:
            if name not in self.lora_modules:
                raise APIError(404, f"the LoRA adapter {name!r} cannot be found", param="lora_name",
                               code="model_not_found")
            self.lora_modules = {k: v for k, v in self.lora_modules.items() if k != name}
            for engine in engines:
                engine.loras.remove(name)
        log.info("unloaded LoRA adapter %s", name)

    def update_weights(self, path: str) -> int:
        """Serve the weights of the full-precision safetensors checkpoint at `path` (the served
        model's architecture and shapes; any subset of its tensors) from now on, without
        recompiling: the requests in flight finish on the old weights, the ones that arrive
        meanwhile wait, then run on the new. The number of tensors loaded; 400 for a checkpoint
        that does not fit the model (checked before anything waits)."""
        from jaxserve import weight_update   # JAX: imported once the engine is up
        from jaxserve.sleep_mode import EngineAsleep

        client = self.require_engine()
        try:
            weights = weight_update.checkpoint_tensors(path)
            weight_update.check_update(client.engine, weights)
            loaded = client.when_idle(lambda engine: weight_update.update_engine(engine, weights))
        except ValueError as e:
            raise APIError(400, str(e), param="model_path") from None
        except EngineAsleep as e:   # its weights sleep (sleep mode): wake them first
            raise APIError(503, str(e)) from None
        log.info("loaded %d tensors from %s", loaded, path)
        return loaded

    def sleep(self, level: int) -> None:
        """vLLM's sleep mode, on every replica (jaxserve/sleep_mode.py): once the requests in flight
        have finished (the ones that arrive meanwhile are held, and run once the engine wakes), the
        weights (level 1: to host memory; 2: dropped) and the KV cache give their memory back; new
        requests get 503 until wake_up. 400 for a multi-host engine."""
        from jaxserve import sleep_mode

        try:
            self.require_engine().when_idle(lambda engine: sleep_mode.sleep(engine, level))
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def wake_up(self, tags: list[str] | None) -> None:
        """The buffers of `tags` (None: all) back on every replica, as they were: nothing recompiles.
        400 for a tag that is not vLLM's ("weights", "kv_cache")."""
        from jaxserve import sleep_mode

        try:
            tags = sleep_mode.checked_tags(tags)
        except ValueError as e:
            raise APIError(400, str(e), param="tags") from None
        self.require_engine().when_idle(lambda engine: sleep_mode.wake_up(engine, tags))

    def is_sleeping(self) -> bool:
        return any(engine.sleeping for engine in self.require_engine().engines)

    def begin_drain(self) -> None:
        """Refuse new requests (503); requests already accepted run to completion."""
        self.draining = True

    def shutdown(self) -> None:
        if self.engine_thread is not None:
            self.engine_thread.shutdown(drain=False)


def version() -> str:
    return importlib.metadata.version("jaxserve")


def _outputs(stream, alive, deadline: float | None, timeout: float | None) -> Iterator:
    """The stream's outputs; the engine failing the request becomes a 500, its deadline a 408."""
    from jaxserve.engine_thread import DeadlineExceeded, RequestFailed

    try:
        yield from stream.outputs(alive, deadline)
    except RequestFailed as e:
        raise APIError(500, str(e), code="engine_error") from None
    except DeadlineExceeded:
        raise APIError(408, f"the request did not finish within its timeout of {timeout:g} s",
                       code="request_timeout") from None


def _log_finished(out) -> None:
    ttft = "-" if out.first_token_time is None else f"{out.first_token_time - out.arrival_time:.3f}s"
    reasons = ",".join(sorted({c.finish_reason for c in out.outputs if c.finish_reason}))
    log.info("%s prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs finish=%s", out.request_id,
             len(out.prompt_token_ids), out.num_generated_tokens, ttft,
             (out.finish_time or time.monotonic()) - out.arrival_time, reasons or "-")
