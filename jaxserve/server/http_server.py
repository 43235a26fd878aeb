"""The HTTP server: uvicorn (asyncio) running the Flask app through a2wsgi, in one process.

A connection costs the event loop a few kB until its request's head and body are in; only then
does the request take one of the threads that run Flask and wait on the engine, so slow or idle
clients hold no thread (benchmarks/results/slow_clients.md: with 1,000 slow + 1,000 idle
connections a normal request took 0.06 s at most, 17 s under gunicorn's threaded worker). What one
connection may cost is bounded: its request head (line and headers) to MAX_HEAD_BYTES, sent
within HEAD_TIMEOUT_S of opening or of its previous response; its body to the app's
MAX_CONTENT_LENGTH (413) within asgi.BODY_TIMEOUT_S (408); idle keep-alive to KEEP_ALIVE_S.

Signals: the first SIGTERM or SIGINT drains: requests that arrive get 503, the listening socket
closes, accepted requests finish (up to DRAIN_TIMEOUT_S), the engine stops and the process
exits 0. A second SIGTERM changes nothing; a second SIGINT (Ctrl-C twice) exits at once, 130.

A lost engine (jaxserve.engine_thread: failed steps in a row) fails every request; /health says
503 for ENGINE_LOST_LINGER_S (load balancers see it, clients get their errors), then the server
stops as on SIGTERM and exits ENGINE_LOST_EXIT, for a supervisor to restart it.
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
import socket
import sys
import time
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.server.asgi import asgi_app

DRAIN_TIMEOUT_S = 120
MAX_HEAD_BYTES = 16 * 1024
HEAD_TIMEOUT_S = 10
KEEP_ALIVE_S = 5
BACKLOG = 2048   # connections the kernel queues before we accept them
LOAD_ERROR_EXIT = 3
ENGINE_LOST_EXIT = 4
ENGINE_LOST_LINGER_S = 2.0
INTERRUPTED_EXIT = 128 + signal.SIGINT

log = logging.getLogger("jaxserve.server")


def exit_on_load_error() -> None:
    logging.shutdown()
    os._exit(LOAD_ERROR_EXIT)


class _BoundedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request head is not complete
    HEAD_TIMEOUT_S after it opened or after its last response (uvicorn's own keep-alive timer
    stops at the first byte, so alone it lets a client drip a head for ever)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:   # a request is in
            self._head_timer.cancel()

    def on_response_complete(self) -> None:
        super().on_response_complete()   # starts a request whose head came in early (pipelined)
        self._head_timer.cancel()
        if not self.transport.is_closing() and self.cycle.response_complete:   # no request is in
            self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self.timeout_keep_alive_handler)

    def connection_lost(self, exc) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_host):
        super().__init__(config)
        self.engine_host = engine_host
        self.exit_code = 0
        self._lost_at: float | None = None

    async def on_tick(self, counter: int) -> bool:
        if self.engine_host.engine_lost is not None and not self.exit_code:
            if self._lost_at is None:
                self._lost_at = time.monotonic()
            elif time.monotonic() - self._lost_at >= ENGINE_LOST_LINGER_S:
                log.critical("the engine is lost: stopping, exit %d", ENGINE_LOST_EXIT)
                self.exit_code = ENGINE_LOST_EXIT
                self.engine_host.begin_drain()
                self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own re-raises the signals once it has stopped: the process would die of its
        # SIGTERM instead of exiting 0 after the drain.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle_exit)
        yield

    def handle_exit(self, sig, frame) -> None:
        name = signal.Signals(sig).name
        if not self.should_exit:
            log.info("%s: draining: new requests get 503, the %d in flight finish (up to %d s)", name,
                     len(self.server_state.tasks), DRAIN_TIMEOUT_S)
            self.engine_host.begin_drain()
            self.should_exit = True
        elif sig == signal.SIGINT:
            log.warning("second SIGINT: stopping now, %d request(s) cut off", len(self.server_state.tasks))
            logging.shutdown()
            os._exit(INTERRUPTED_EXIT)


class HTTPServer:
    def __init__(self, app_factory: Callable, host: str, port: int, threads: int):
        self.app_factory, self.host, self.port, self.threads = app_factory, host, port, threads

    def run(self) -> None:
        _raise_fd_limit()
        # Listen before the engine starts loading, so a port in use fails at once and plainly.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            listener = socket.create_server((self.host, self.port), family=family, backlog=BACKLOG)
        except OSError as e:
            sys.exit(f"jaxserve serve: cannot listen on {self.host}:{self.port}: {e.strerror}")
        log.info("listening on http://%s:%d (pid %d)", self.host, self.port, os.getpid())
        app = self.app_factory()
        engine_host = app.extensions["jaxserve"]
        config = uvicorn.Config(
            asgi_app(app, self.threads, app.config["MAX_CONTENT_LENGTH"]), host=self.host, port=self.port,
            http=_BoundedH11Protocol, loop="asyncio", lifespan="off", log_config=None, access_log=False,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES, timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=DRAIN_TIMEOUT_S, backlog=BACKLOG)
        server = _DrainingServer(config, engine_host)
        server.run(sockets=[listener])
        engine_host.shutdown()
        log.info("stopped (pid %d)", os.getpid())
        # Skip interpreter teardown: destroying the XLA client and its compiled steps takes
        # seconds, and nothing is left to flush but the logs.
        logging.shutdown()
        os._exit(server.exit_code)


def _raise_fd_limit() -> None:
    """One file descriptor per connection: take the hard limit (the soft one is often 1,024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
