"""Slow and idle clients against a server on 127.0.0.1, while normal requests are timed.

Slow connections send a request line, then one header line a second, never finishing the
head; idle ones connect and send nothing. Both reconnect when the server closes them, so the
load lasts the whole run. Everything stops by itself after `seconds`.

Measurement (what chose the server layer): `python -m tests.slow_clients URL --slow 1000 --idle 1000`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import time
import urllib.parse

import requests


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise RuntimeError(f"need {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def _hold(host: str, port: int, stop: dict, drip: bool, counts: dict) -> None:
    """One connection slot: connect, drip (or idle) until the server closes it, reconnect; until
    stop["at"] (the time.monotonic() at which to stop, which run_load moves once all are held)."""
    while time.monotonic() < stop["at"]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["refused"] += 1
            await asyncio.sleep(0.5)
            continue
        counts["opened"] += 1
        try:
            if drip:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            closed = asyncio.ensure_future(reader.read())   # done when the server closes it
            line = 0
            while not closed.done() and time.monotonic() < stop["at"]:
                await asyncio.wait([closed], timeout=min(1.0, max(0.0, stop["at"] - time.monotonic())))
                if drip and not closed.done():
                    writer.write(b"X-Slow-%d: %s\r\n" % (line, b"y" * 16))
                    line += 1
            if closed.done():
                counts["closed_by_server"] += 1
            closed.cancel()
        except OSError:
            counts["closed_by_server"] += 1
        finally:
            writer.close()


def probe(url: str, timeout: float = 30) -> float:
    """Seconds for one normal completion on a fresh connection (inf if it failed)."""
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                          timeout=timeout,
                          headers={"Connection": "close"})
        ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    except requests.RequestException:
        ok = False
    return time.monotonic() - t0 if ok else float("inf")


def stream(url: str, max_tokens: int = 16, timeout: float = 30) -> tuple[int, int]:
    """(chunks with text, completion tokens) of one streamed completion ending in [DONE]."""
    r = requests.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": max_tokens, "stream": True,
                                                     "ignore_eos": True, "stream_options": {"include_usage": True}},
                      stream=True, timeout=timeout)
    assert r.status_code == 200, r.text
    lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]", lines[-3:]
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return len(events) - 1, events[-1]["usage"]["completion_tokens"]


async def run_load(url: str, slow: int, idle: int, seconds: float, probes: int, ramp_limit_s: float = 20.0) -> dict:
    """Opens the slow and idle connections and, once all are held (or after `ramp_limit_s`), holds
    them `seconds` more while timing `probes` normal requests one after another. Returns the probe
    latencies and connection counts. The window starts when the load is in place, not after a fixed
    ramp: beside other work the client's own loop may take seconds to open them all."""
    parsed = urllib.parse.urlsplit(url)
    counts = {"opened": 0, "refused": 0, "closed_by_server": 0}
    ramp_end = time.monotonic() + ramp_limit_s
    stop = {"at": ramp_end + seconds}
    holders = [asyncio.ensure_future(_hold(parsed.hostname, parsed.port, stop, i < slow, counts))
               for i in range(slow + idle)]
    while counts["opened"] < slow + idle and time.monotonic() < ramp_end:
        await asyncio.sleep(0.1)
    held_at_probe = counts["opened"]
    stop["at"] = time.monotonic() + seconds
    latencies = []
    for _ in range(probes):
        if time.monotonic() >= stop["at"]:
            break
        latencies.append(await asyncio.to_thread(probe, url))
        await asyncio.sleep(0.2)
    chunks, tokens = await asyncio.to_thread(stream, url)
    await asyncio.gather(*holders)
    return {"latencies": latencies, "stream_chunks": chunks, "stream_tokens": tokens,
            "held_at_first_probe": held_at_probe, **counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--slow", type=int, default=1000)
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--probes", type=int, default=10)
    args = p.parse_args()
    raise_fd_limit(args.slow + args.idle + 256)
    print(f"baseline (no load): {probe(args.url):.3f} s")
    result = asyncio.run(run_load(args.url, args.slow, args.idle, args.seconds, args.probes))
    lat = result.pop("latencies")
    finite = [x for x in lat if x != float("inf")]
    print(f"{args.slow} slow + {args.idle} idle connections: {len(finite)}/{len(lat)} probes answered; "
          f"median {statistics.median(lat):.3f} s, max {max(lat):.3f} s; {result}")


if __name__ == "__main__":
    main()
