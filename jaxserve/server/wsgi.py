"""The production WSGI server: gunicorn, run in-process through its BaseApplication API.

One worker process, since the engine (weights, KV cache, compiled steps) lives in it; inside it
gunicorn's gthread worker gives every connection a thread, so a streaming response holds only
its own thread and each yielded SSE event goes straight to the socket as an HTTP chunk. The
master process imports no JAX: it binds the socket, forks the worker, and on SIGTERM asks the
worker to stop. The worker then refuses new requests (503), lets the in-flight ones finish (up
to DRAIN_TIMEOUT_S), stops the engine and exits 0.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import ThreadWorker

DRAIN_TIMEOUT_S = 120
WORKER_BOOT_ERROR = 3   # gunicorn's "worker failed to boot" exit code: the master then exits too


def _host(worker):
    app = getattr(worker, "wsgi", None)
    return app.extensions["jaxserve"] if app is not None else None


class ServingWorker(ThreadWorker):
    def handle_exit(self, sig, frame):   # SIGTERM
        host = _host(self)
        if host is not None:
            host.begin_drain()
        super().handle_exit(sig, frame)
        # Refuse new connections at once rather than leave them in the backlog until exit (the
        # master has closed its copy of the listening socket already).
        self.set_accept_enabled(False)
        for listener in self.sockets:
            listener.sock.close()

    def run(self):
        code = 0
        try:
            super().run()    # returns once the in-flight connections are done
        except Exception:
            self.log.exception("worker failed")
            code = 1
        host = _host(self)
        if host is not None:
            host.shutdown()
        # Skip interpreter teardown: destroying the XLA client and its compiled steps takes
        # seconds, and nothing is left to flush but the logs.
        self.log.info("Worker exiting (pid: %s)", self.pid)
        logging.shutdown()
        os._exit(code)


def exit_worker_on_load_error() -> None:
    os._exit(WORKER_BOOT_ERROR)


class GunicornServer(BaseApplication):
    def __init__(self, app_factory: Callable, host: str, port: int, threads: int):
        self.app_factory = app_factory
        self.options = {
            "bind": f"{host}:{port}",
            "workers": 1,
            "worker_class": ServingWorker,
            "threads": threads,
            "worker_connections": max(1000, 2 * threads),
            "timeout": 300,             # heartbeat; warm-up runs in a background thread
            "graceful_timeout": DRAIN_TIMEOUT_S,
            "keepalive": 5,
            "accesslog": None,          # the server logs one line per generation request itself
            "errorlog": "-",
            "loglevel": "info",
            "proc_name": "jaxserve",
            "control_socket_disable": True,   # no ~/.gunicorn/gunicorn.ctl shared between servers
        }
        super().__init__()

    def load_config(self):
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):
        return self.app_factory()
