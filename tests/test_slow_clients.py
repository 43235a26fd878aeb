"""Slow and idle clients cannot stall the real server: with 1,000 connections dripping a header
line a second and 1,000 idle ones (one client), a normal completion answers within 1 s and SSE
still streams; each connection's cost is bounded (head size, head time, idle keep-alive)."""
import asyncio
import concurrent.futures
import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn

from jaxserve.server import asgi, http_server
from jaxserve.server.http_server import HEAD_TIMEOUT_S, KEEP_ALIVE_S, MAX_HEAD_BYTES
from tests.server_harness import BYTES_ENGINE, bytes_model_dir, serving
from tests.slow_clients import probe, raise_fd_limit, run_load, stream

SLOW = IDLE = 1000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("server"), bytes_model_dir(tmp_path_factory), "--served-model-name",
                       "jaxserve-tiny", **BYTES_ENGINE)


def test_slow_and_idle_connections_do_not_delay_a_request(server):
    raise_fd_limit(SLOW + IDLE + 256)
    assert probe(server.url) < 1.0   # warm
    # Longer than HEAD_TIMEOUT_S, so the server also shows it closes heads that never end.
    result = asyncio.run(run_load(server.url, SLOW, IDLE, seconds=HEAD_TIMEOUT_S + 4, probes=8))
    assert result["held_at_first_probe"] >= SLOW + IDLE, result
    assert result["refused"] == 0, result
    assert len(result["latencies"]) >= 5 and max(result["latencies"]) < 1.0, result
    assert result["stream_tokens"] == 16 and result["stream_chunks"] > 1, result   # streamed, not in one piece
    assert result["closed_by_server"] >= SLOW, result   # dripped heads cut at HEAD_TIMEOUT_S
    assert stream(server.url, max_tokens=4)[1] == 4   # and the server is fine afterwards


def _closed_after(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reading and discarding what it sends)."""
    t0 = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(65536):
        pass
    return time.monotonic() - t0


def test_connection_bounds(server):
    host, port = server.url.removeprefix("http://").split(":")
    addr = (host, int(port))
    # A head over MAX_HEAD_BYTES: 400 and closed, without waiting for the rest.
    with socket.create_connection(addr) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 1024))
        assert sock.recv(64).startswith(b"HTTP/1.1 400")
    # Both timers at once, each on its own connection (one after the other they waited 15 s):
    # a kept-alive connection left idle is closed after KEEP_ALIVE_S; a head that never ends is
    # closed HEAD_TIMEOUT_S after the connection opened.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        idle, endless = pool.submit(_idle_after_a_response, addr), pool.submit(_endless_head, addr)
        assert KEEP_ALIVE_S - 0.5 < idle.result() < KEEP_ALIVE_S + 2
        assert HEAD_TIMEOUT_S - 0.5 < endless.result() < HEAD_TIMEOUT_S + 2


def _idle_after_a_response(addr) -> float:
    with socket.create_connection(addr) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        return _closed_after(sock, KEEP_ALIVE_S + 5)


def _endless_head(addr) -> float:
    with socket.create_connection(addr) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        return _closed_after(sock, HEAD_TIMEOUT_S + 5)


def test_a_stalled_body_gets_408_without_taking_a_thread(monkeypatch):
    """In-process: a client that sent its head and then stalls mid-body is answered 408 by the
    event loop after BODY_TIMEOUT_S; the Flask side (a thread) is never called."""
    monkeypatch.setattr(asgi, "BODY_TIMEOUT_S", 0.2)
    called, sent = [], []

    def wsgi_app(environ, start_response):
        called.append(environ["PATH_INFO"])
        start_response("200 OK", [])
        return [b"ok"]

    parts = [{"type": "http.request", "body": b'{"pro', "more_body": True}]

    async def receive():   # part of the body, then nothing
        if parts:
            return parts.pop()
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/v1/completions",
             "query_string": b"", "headers": [(b"content-length", b"20")]}
    asyncio.run(asgi.asgi_app(wsgi_app, threads=1, max_body_bytes=100)(scope, receive, send))
    assert sent[0]["status"] == 408
    assert json.loads(sent[1]["body"])["error"]["message"].startswith("request body not received")
    assert called == []


def test_a_long_request_on_a_kept_alive_connection_is_not_cut(monkeypatch):
    """In-process, the real protocol: a request whose head came in before the previous response
    had ended (pipelined, or sent as soon as the body was in, while the server still closed the
    response) runs longer than HEAD_TIMEOUT_S and still gets its whole answer. The head timer
    armed at the first response's end once closed the connection under it (a soak's long
    completion, 2026-11-29)."""
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await asyncio.sleep(1.5 if scope["path"] == "/slow" else 0)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, http=http_server._BoundedH11Protocol, lifespan="off",
                                               log_config=None, timeout_keep_alive=5))
        server.capture_signals = contextlib.nullcontext   # not the main thread
        thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]})
        thread.start()
        try:
            while not server.started:
                time.sleep(0.01)
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
                sock.settimeout(5)
                got = b""
                while got.count(b"ok") < 2 and (chunk := sock.recv(65536)):
                    got += chunk
            assert got.count(b"HTTP/1.1 200") == 2 and got.endswith(b"ok"), got
        finally:
            server.should_exit = True
            thread.join(10)
