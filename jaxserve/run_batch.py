"""`jaxserve run-batch`: a file of OpenAI Batch API requests run offline, as vLLM's `run-batch`.

Each input line is one request, `{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
"body": {...}}`; each output line, in input order, its result: `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`, the body what the server's route answers
(a 4xx error body included), or, for a line that is no request (not JSON, not a POST to a /v1/
route, a stream asked for), `"response": null` and `"error": {"code", "message"}`. The requests
go through the server's own routes (the Flask app in-process, no socket), so they are checked and
answered exactly as served, and enough at once to keep every sequence of the engine busy.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
import uuid

log = logging.getLogger("jaxserve.run_batch")


class BadLine(ValueError):
    """An input line that is no request; custom_id: the one it gives, if it gives one (None where it is not JSON)."""

    def __init__(self, message: str, custom_id=None):
        super().__init__(message)
        self.custom_id = custom_id


def request_of(line: str) -> tuple[str, str, dict]:
    """(custom_id, url, body) of an input line, its JSON parsed once; BadLine saying what is wrong with it."""
    try:
        item = json.loads(line)
    except ValueError as e:
        raise BadLine(f"not JSON: {e}") from None
    if not isinstance(item, dict):
        raise BadLine("a line must be a JSON object")
    custom_id, url, body = item.get("custom_id"), item.get("url"), item.get("body")
    if not isinstance(custom_id, str):
        raise BadLine("'custom_id' must be a string", custom_id)
    if item.get("method", "POST") != "POST" or not isinstance(url, str) or not url.startswith("/v1/"):
        raise BadLine("a request must be a POST to a /v1/ route ('method', 'url')", custom_id)
    if not isinstance(body, dict):
        raise BadLine("'body' must be a JSON object", custom_id)
    if body.get("stream"):
        raise BadLine("'stream' is not available in a batch", custom_id)
    return custom_id, url, body


def run(app, input_path: str, output_path: str, concurrency: int) -> tuple[int, int]:
    """Answers every line of `input_path` into `output_path` through the app's routes, once its
    engine is warm; returns (requests answered 200, lines in all). RuntimeError if the engine failed to load."""
    client = app.test_client()
    while client.get("/health").status_code != 200:
        if app.extensions["jaxserve"].load_error is not None:
            raise RuntimeError(f"the engine failed to load: {app.extensions['jaxserve'].load_error}")
        time.sleep(0.1)
    local = threading.local()   # a test client per thread

    def answer(line: str) -> dict:
        result = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": None, "response": None, "error": None}
        try:
            result["custom_id"], url, body = request_of(line)
        except BadLine as e:
            return {**result, "custom_id": e.custom_id, "error": {"code": "invalid_request", "message": str(e)}}
        if not hasattr(local, "client"):
            local.client = app.test_client()
        r = local.client.post(url, json=body)
        data = r.get_json(silent=True)
        request_id = data.get("id") if isinstance(data, dict) else None
        return {**result, "response": {"status_code": r.status_code, "request_id": request_id, "body": data}}

    answered = lines = 0
    with open(input_path) as f:
        requests = [line for line in f if line.strip()]
    t0 = time.monotonic()
    with open(output_path, "w") as out, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for result in pool.map(answer, requests):   # in input order, as they complete
            out.write(json.dumps(result, ensure_ascii=False) + "\n")
            lines += 1
            answered += result["response"] is not None and result["response"]["status_code"] == 200
    log.info("%d of %d requests answered 200 in %.1fs", answered, lines, time.monotonic() - t0)
    return answered, lines
