"""The Flask app as an ASGI app, for the asyncio HTTP server (see http_server.py).

a2wsgi runs each request in a thread of a pool sized for every request the engine can hold.
Before a request takes a thread, its whole body is read on the event loop (bounded in size and
time), so a slow upload holds no thread; while it runs, the event loop watches for the client
leaving and sets an Event the routes poll (`client_gone`), since the server drops what a gone
client would have been sent without telling the app.
"""
from __future__ import annotations

import asyncio
import json
import threading

from a2wsgi import WSGIMiddleware

from jaxserve.server.errors import APIError

BODY_TIMEOUT_S = 30   # for the whole request body, once the head is in
CLIENT_GONE = "jaxserve.client_gone"   # the scope key of the Event (a2wsgi passes the scope on)


def client_gone(environ) -> threading.Event | None:
    """The Event set when this request's client has gone (None outside this server)."""
    return environ.get("asgi.scope", {}).get(CLIENT_GONE)


def asgi_app(wsgi_app, threads: int, max_body_bytes: int):
    inner = WSGIMiddleware(wsgi_app, workers=threads)

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        try:
            body = await asyncio.wait_for(_read_body(scope, receive, max_body_bytes), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return await _send_error(send, APIError(408, f"request body not received within {BODY_TIMEOUT_S} s"))
        if body is None:   # the client left before its body was in
            return
        gone = scope[CLIENT_GONE] = threading.Event()
        watcher = asyncio.ensure_future(_watch_disconnect(receive, gone))
        sent = False

        async def replay():   # the buffered body, once; a2wsgi asks for no more after it
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await inner(scope, replay, send)
        finally:
            watcher.cancel()
    return app


async def _read_body(scope, receive, max_body_bytes: int) -> bytes | None:
    """The request body, or None if the client left. Reading stops past `max_body_bytes`, and
    does not start when Content-Length already says too much: Flask then answers 413."""
    declared = dict(scope["headers"]).get(b"content-length", b"0")
    if declared.isdigit() and int(declared) > max_body_bytes:
        return b""
    chunks, size = [], 0
    while size <= max_body_bytes:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _watch_disconnect(receive, gone: threading.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _send_error(send, error: APIError) -> None:
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": json.dumps(error.body()).encode()})
