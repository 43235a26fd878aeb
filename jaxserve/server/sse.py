"""Server-Sent Events: each event is written to the socket as soon as it is produced (the HTTP
server sends every yielded piece as its own HTTP chunk), then `data: [DONE]`.

The first event is produced before the response starts, so a request the engine refuses after
submission still gets a proper HTTP error. When the client goes away the stream stops at its
next event (the server drops what it would send, so the body asks the server's `client_gone`);
closing `events` then aborts the engine requests (see EngineHost.follow).
"""
from __future__ import annotations

import json
import logging
from typing import Iterator

from flask import Response, request

from jaxserve.server.asgi import client_gone
from jaxserve.server.errors import APIError

log = logging.getLogger(__name__)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(events: Iterator[dict]) -> Response:
    try:
        first = next(events, None)
    except ValueError as e:   # refused by the engine (e.g. KV pool too small for the request)
        raise APIError(400, str(e)) from None
    gone = client_gone(request.environ)

    def body():
        try:
            if first is not None:
                yield _event(first)
            for event in events:
                if gone is not None and gone.is_set():
                    break
                yield _event(event)
        except APIError as e:   # the status line is sent: report in-band, as OpenAI does
            yield _event(e.body())
        except Exception as e:
            log.exception("stream failed")
            yield _event(APIError(500, f"internal error: {e}").body())
        finally:
            events.close()
        yield "data: [DONE]\n\n"

    return Response(body(), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
