"""Every signal path of the real server, with requests in flight: SIGTERM or SIGINT, to the
process or to its whole process group (systemd's KillMode=control-group, a terminal's Ctrl-C),
once or twice. Accepted requests finish, new ones are refused (503 or connection refused), the
process exits 0 with no traceback; a second SIGINT stops at once with 130 and one log line."""
import concurrent.futures
import json
import os
import signal
import time

import pytest
import requests

from tests.server_harness import LONG_ENGINE, ServerProcess, long_model, start

# Long enough that all requests are still in flight when the signal lands, though the test
# process may stall while the box runs four servers (the checks below fail if any request finished
# before the signal). 1000 tokens took 3.5-10 s a request beside the rest of the suite
# (2026-11-27), 2000 twice that: decoding is most of this file's CPU time.
MAX_TOKENS = 1000
STREAMS = 3   # and one plain request: the 4 that LONG_ENGINE runs at once
# Runs of each path, each with a fresh server (about 6 s of start-up), PARALLEL at a time: SIGTERM
# to the group, the path that raced under the former gunicorn server (two exit handlers), runs
# twice in `make test`, the others once (8 runs: two rounds of servers);
# JAXSERVE_SHUTDOWN_RUNS=10 runs each path 10 times.
RUNS = int(os.environ.get("JAXSERVE_SHUTDOWN_RUNS", 1))
GROUP_RUNS = max(2, RUNS)
PARALLEL = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return long_model(tmp_path_factory)


def _send(server: ServerProcess, to_group: bool, sig: int) -> None:
    if to_group:
        os.killpg(server.proc.pid, sig)   # the harness starts the server in its own session
    else:
        server.proc.send_signal(sig)


def _start_requests(server: ServerProcess, pool):
    """STREAMS streamed and one non-streamed completion, each running in the engine."""
    body = {"prompt": "hi", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}

    def open_stream(i):
        r = requests.post(server.url + "/v1/completions", stream=True, timeout=120, json={
            **body, "prompt": f"p{i}", "stream": True, "stream_options": {"include_usage": True}})
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")
        return lines

    # All four at once: opened one after another, the first had run up to 2.8 s when the signal
    # came (in `make test`, 2026-11-27), a third of what its MAX_TOKENS take.
    plain = pool.submit(requests.post, server.url + "/v1/completions", json=body, timeout=120)
    streams = [f.result() for f in [pool.submit(open_stream, i) for i in range(STREAMS)]]
    deadline = time.monotonic() + 30
    while server.metrics()["jaxserve_num_sequences_running"] < STREAMS + 1:
        assert time.monotonic() < deadline, "the requests did not all start"
        time.sleep(0.01)
    return streams, plain


def _refused(url: str) -> None:
    """New requests get 503 until the listening socket closes, which it does at once."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            assert requests.post(url + "/v1/completions", json={"prompt": "late"}, timeout=10).status_code == 503
        except requests.ConnectionError:
            return
        time.sleep(0.02)
    raise AssertionError("still accepting connections 10 s after the signal")


def _stream_tokens(lines) -> int:
    """The completion tokens of a stream that ended properly: finish_reason, usage, [DONE]."""
    events = [line for line in lines if line]
    assert events[-1] == b"data: [DONE]"
    assert b'"finish_reason":"length"' in events[-3]
    return json.loads(events[-2][6:])["usage"]["completion_tokens"]


def _drain_run(model, workdir, signals: list[tuple[bool, int]]) -> None:
    server = start(workdir, model, **LONG_ENGINE)
    try:
        with concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
            streams, plain = _start_requests(server, pool)
            for to_group, sig in signals:
                _send(server, to_group, sig)
                time.sleep(0.05)
            _refused(server.url)
            tokens = list(pool.map(_stream_tokens, streams))
            finished = plain.result()
        assert tokens == [MAX_TOKENS] * STREAMS
        assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert server.proc.wait(60) == 0, server.log_tail()
        log = server.log_tail(10**6)
        assert "Traceback" not in log, log
        assert log.count("draining") == 1   # later signals change nothing
        assert log[log.index("draining"):].count("finish=length") == STREAMS + 1   # in flight at the signal
    finally:
        server.kill()


def _interrupt_run(model, workdir) -> None:
    """Ctrl-C twice in a terminal: SIGINT to the group, then again once the drain has begun (two
    sent before the first is handled merge into one: a starved process then drains and exits 0)."""
    server = start(workdir, model, **LONG_ENGINE)
    try:
        with concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
            streams, plain = _start_requests(server, pool)
            _send(server, True, signal.SIGINT)
            deadline = time.monotonic() + 10
            while "draining" not in server.log_tail(10**6):
                assert time.monotonic() < deadline, "the first SIGINT was not handled"
                time.sleep(0.01)
            t0 = time.monotonic()
            _send(server, True, signal.SIGINT)
            assert server.proc.wait(10) == 128 + signal.SIGINT
            stopped_after = time.monotonic() - t0
            with pytest.raises(requests.RequestException):   # cut off, not finished
                plain.result()
        assert stopped_after < 5
        log = server.log_tail(10**6)
        assert "Traceback" not in log, log
        assert log.count("second SIGINT") == 1
    finally:
        server.kill()


DRAIN_PATHS = {
    "term": [(False, signal.SIGTERM)],
    "int": [(False, signal.SIGINT)],
    "term-twice": [(False, signal.SIGTERM), (False, signal.SIGTERM)],
    "term-group": [(True, signal.SIGTERM)],
    "int-group": [(True, signal.SIGINT)],
    "term-group-twice": [(True, signal.SIGTERM), (True, signal.SIGTERM)],
}


def _times(path: str) -> int:
    return GROUP_RUNS if path == "term-group" else RUNS


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """{path: [each run's future]}, each run with a fresh server, PARALLEL servers at a time
    (start-up dominates; the first compiles alone, the others load its executables)."""
    def run(path, i):
        workdir = tmp_path_factory.mktemp(f"{path}-{i}")
        if path == "int-twice":
            return _interrupt_run(model, workdir)
        return _drain_run(model, workdir, DRAIN_PATHS[path])

    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        futures = {path: [pool.submit(run, path, i) for i in range(_times(path))] for path in [*DRAIN_PATHS, "int-twice"]}
        concurrent.futures.wait([f for fs in futures.values() for f in fs])
    return futures


def _failures(futures) -> dict:
    return {i: repr(f.exception()) for i, f in enumerate(futures) if f.exception() is not None}


@pytest.mark.parametrize("path", list(DRAIN_PATHS))
def test_drain_and_exit_0_every_time(runs, path):
    assert len(runs[path]) >= RUNS and not _failures(runs[path]), _failures(runs[path])


def test_second_sigint_stops_at_once_every_time(runs):
    assert not _failures(runs["int-twice"]), _failures(runs["int-twice"])
