"""Engine faults fail requests, not the server; deadlines end requests. Through the real server
and a real HTTP client, with faults injected by JAXSERVE_FAULT_STEPS:

  * one failing step: its requests get clean errors (500 JSON; an error event then [DONE] in a
    stream), a request waiting meanwhile is served, the KV pages all come back, and the next
    request gives the same greedy text as before the fault;
  * failing steps in a row (a lost device): /health says 503 and the process exits non-zero,
    with the failure logged once;
  * deadlines (`timeout` in the body, the server's --request-timeout) for running and waiting
    requests, with their pages freed.
"""
import concurrent.futures
import json
import os
import time
from unittest import mock

import pytest
import requests

from jaxserve.engine import FAULT_STEPS_ENV
from jaxserve.server.http_server import ENGINE_LOST_EXIT
from tests.server_harness import LONG_ENGINE, long_model, start

MAX_TOKENS = 600        # about 2 s of steps here: still running at the fault, past the deadlines
FAULT_STEP = 500        # steps are about 1 ms: after the requests below are all in, before they end
# The deadline server's requests run for 2 s or more, well past both deadlines.
LONG_TOKENS = 2000
SERVER_TIMEOUT_S = 1.0  # its --request-timeout
BODY_TIMEOUT_S = 0.2    # a request's own, shorter, `timeout`


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers of test_shutdown.py's model and engine (4 running at most; the executables
    are built once for both files): deadlines, one failing step, steps failing in a row."""
    model = long_model(tmp_path_factory)
    specs = {"deadline": ({}, ["--request-timeout", str(SERVER_TIMEOUT_S)], LONG_ENGINE),
             "fault": ({FAULT_STEPS_ENV: str(FAULT_STEP)}, [], LONG_ENGINE),
             "lost": ({FAULT_STEPS_ENV: "1,2"}, [], dict(LONG_ENGINE, max_failed_steps=2))}
    started = {}
    try:
        for name, (env, args, engine) in specs.items():
            with mock.patch.dict(os.environ, env):   # the server process inherits it
                started[name] = start(tmp_path_factory.mktemp(name), model, *args, **engine)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _body(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, **kw}


def _post(server, body: dict) -> requests.Response:
    return requests.post(server.url + "/v1/completions", json=body, timeout=120)


def _open_stream(server, body: dict):
    """A started stream's event lines, its first data event already read."""
    r = requests.post(server.url + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    lines = (line for line in r.iter_lines() if line)
    first = next(lines)
    assert first.startswith(b"data: {"), first
    return lines


def _stream_end(lines) -> tuple[int, dict | None]:
    """(chunks after the first, the error event or None) of a stream that ended with [DONE]."""
    events = list(lines)
    assert events[-1] == b"data: [DONE]", events[-3:]
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    errors = [b for b in bodies if "error" in b]
    assert len(errors) <= 1 and (not errors or bodies[-1] is errors[0]), "an error event ends the stream"
    return len(bodies) - len(errors), errors[0]["error"] if errors else None


def _wait_for(server, running: int, waiting: int) -> dict:
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if (m["jaxserve_num_sequences_running"], m["jaxserve_num_sequences_waiting"]) == (running, waiting):
            return m
        assert time.monotonic() < deadline, f"not {running} running and {waiting} waiting: {m}"
        time.sleep(0.01)


def test_a_failing_step_fails_its_requests_only(servers):
    server = servers["fault"]
    free_at_start = server.metrics()["jaxserve_kv_free_pages"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = _open_stream(server, _body("a stream"))
        plain = [pool.submit(_post, server, _body(f"plain {i}")) for i in range(4)]
        m = _wait_for(server, running=4, waiting=1)   # one of the plain requests waits for a slot
        assert m["jaxserve_failed_steps_total"] == 0, "the fault came before every request was in"
        chunks, error = _stream_end(stream)
        plain = [f.result() for f in plain]
    assert chunks >= 1 and error["code"] == "engine_error" and "InjectedFault" in error["message"], error
    failed = [r for r in plain if r.status_code != 200]
    assert len(failed) == 3, [r.text for r in plain]
    for r in failed:
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "internal_server_error"
        assert r.json()["error"]["code"] == "engine_error"
    served = next(r for r in plain if r.status_code == 200)   # the one that waited
    assert served.json()["usage"]["completion_tokens"] == MAX_TOKENS
    m = server.metrics()
    assert m["jaxserve_failed_steps_total"] == 1
    assert m["jaxserve_kv_free_pages"] == free_at_start
    # The next request: the same greedy text as from a server that never failed.
    after, reference = (_post(s, _body("the same prompt", max_tokens=16)) for s in (server, servers["deadline"]))
    assert after.status_code == reference.status_code == 200
    assert after.json()["choices"] == reference.json()["choices"]
    log = server.log_tail(10**6)
    assert log.count("engine step failed") == 1 and log.count("Traceback") == 1, log


def test_steps_failing_in_a_row_stop_the_server(servers):
    server = servers["lost"]
    first = _post(server, _body("step 1 fails"))    # alone in step 1: failed, the engine goes on
    assert first.status_code == 500 and first.json()["error"]["code"] == "engine_error"
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    second = _post(server, _body("step 2 fails"))   # the second failure in a row: the engine is lost
    assert second.status_code == 500 and second.json()["error"]["code"] == "engine_error"
    health = requests.get(server.url + "/health", timeout=10)
    assert health.status_code == 503 and "lost" in health.json()["error"]["message"]
    assert _post(server, _body("after")).status_code == 503
    assert server.proc.wait(60) == ENGINE_LOST_EXIT
    log = server.log_tail(10**6)
    assert log.count("engine step failed") == 1 and log.count("engine lost") == 1, log
    assert log.count("Traceback") == 1, log


def test_deadlines_end_running_and_waiting_requests(servers):
    server = servers["deadline"]
    free_at_start = server.metrics()["jaxserve_kv_free_pages"]
    assert _post(server, _body("x", timeout="soon")).status_code == 400
    long = dict(max_tokens=LONG_TOKENS)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stream = _open_stream(server, _body("a stream", **long))
        running = [pool.submit(_post, server, _body(f"plain {i}", **long)) for i in range(3)]
        _wait_for(server, running=4, waiting=0)
        waited = _post(server, _body("waits", timeout=BODY_TIMEOUT_S))
        assert not any(f.done() for f in running), "a slot came free: the request did not only wait"
        chunks, error = _stream_end(stream)
        running = [f.result() for f in running]
    assert 1 <= chunks < LONG_TOKENS and error["code"] == "request_timeout", error
    t0 = time.monotonic()
    alone = _post(server, _body("in a hurry", timeout=BODY_TIMEOUT_S, **long))
    assert time.monotonic() - t0 < SERVER_TIMEOUT_S
    for r, limit in zip(running + [waited, alone], [SERVER_TIMEOUT_S] * 3 + [BODY_TIMEOUT_S] * 2):
        assert r.status_code == 408, r.text
        assert r.json()["error"]["code"] == "request_timeout"
        assert r.json()["error"]["message"].endswith(f"timeout of {limit:g} s"), r.text
    _wait_for(server, running=0, waiting=0)
    assert server.metrics()["jaxserve_kv_free_pages"] == free_at_start
