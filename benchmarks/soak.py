"""Soak: the real server (`python -m jaxserve.cli serve`, the embedded model) under mixed load for
a while, with engine faults injected, checking that nothing is lost.

The load (benchmarks/soak_load.py) comes from --clients closed-loop clients: streamed and plain
completions and chat, n up to 3, stop strings, presence penalties, long prompts that force preemption in the small
KV pool below, clients that leave mid-stream, deadlines too short to meet, 10% malformed requests.
Every --fault-every-th engine step raises (JAXSERVE_FAULT_STEPS). Once a second the KV pages free
(/metrics) and the server's resident memory (/proc) are sampled. The checks:
  * every accepted request ended with full output or a clear error (none LOST);
  * the free-page count, once the load stops, is back to its value before it;
  * resident memory grows less than 5% after warm-up (the first fifth of the run);
  * p99 time to first token (short-prompt streams) in the last fifth is within 1.5x of the first;
  * the faults were injected, preemption happened, and the server exits 0 on SIGTERM.

  python -m benchmarks.soak --duration 300 --out benchmarks/results/soak

Writes <out>.json, <out>.md and <out>.png (p99 TTFT, free pages and resident memory over time);
exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import (command_line, load_average, machine_line, markdown_table, percentiles, pyplot,
                               report_header, save_figure, write_keeping_notes, write_text)
from benchmarks.soak_load import KINDS, Client

# A KV pool of 32 pages of 32 tokens: two long prompts (300-450 tokens + 100-180 generated, up
# to 20 pages each) overfill it, so the scheduler preempts. Two prefill rows: a short prompt need
# not wait behind a long one's prefill (or its recompute after preemption).
ENGINE = dict(max_model_len=640, page_size=32, num_pages=32, max_num_seqs=8, max_num_batched_tokens=32,
              prefill_chunk_size=32, max_prefill_seqs=2, max_queue_size=64)
VOCAB_SIZE = 4096   # the embedded model's
MAX_RSS_GROWTH = 0.05
MAX_TTFT_RATIO = 1.5
WINDOW_S = 10       # the plot's p99 TTFT windows
TTFT_KINDS = ("stream", "chat")
TTFT_CHECK = f"p99 TTFT last fifth <= {MAX_TTFT_RATIO}x first fifth"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=300, help="seconds of load")
    p.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    p.add_argument("--fault-every", type=int, default=2000, help="every N-th engine step raises")
    p.add_argument("--compilation-cache-dir", default="~/.cache/jaxserve/xla")
    p.add_argument("--decode-steps", type=int, default=1, help="the engine's decode_steps (multi-step decoding)")
    p.add_argument("--step-shapes", choices=["all", "largest"], default="all", help="the engine's step_shapes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join("benchmarks", "results", "soak"))
    args = p.parse_args(argv)
    report = run(args, command_line("soak", argv))
    write_text(args.out + ".json", json.dumps(report, indent=1))
    write_keeping_notes(args.out + ".md", markdown(report))   # the notes below the marker stay
    plot(report, args.out + ".png")
    print(markdown(report))
    return 0 if all(c["ok"] for c in report["checks"]) else 1


def run(args, command: str = "") -> dict:
    engine = {**ENGINE, "decode_steps": args.decode_steps, "step_shapes": args.step_shapes}
    with tempfile.TemporaryDirectory() as workdir:
        server = Server(workdir, {**engine, "compilation_cache_dir": args.compilation_cache_dir}, args.fault_every)
        try:
            server.wait_ready()
            result = soak(server, args)
            if any(r["outcome"].startswith("LOST") for r in result["requests"]):   # what the server saw
                result["server_log"] = server.log_tail(16000)
            result["exit_code"] = server.stop()
        finally:
            server.kill()
    report = {**report_header(command, args), "engine": engine, "plot": os.path.basename(args.out) + ".png", **result}
    return {**report, "checks": checks(report)}


class Server:
    def __init__(self, workdir: str, engine: dict, fault_every: int):
        config = os.path.join(workdir, "engine.yaml")
        with open(config, "w") as f:
            yaml.safe_dump(engine, f)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        # Far apart, so faults never come max_failed_steps in a row; enough for hours of steps.
        faults = ",".join(str(fault_every * i) for i in range(1, 2000))
        self.log = open(os.path.join(workdir, "server.log"), "w+b")
        self.proc = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "serve", "--config", config,
                                      "--port", str(port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "JAXSERVE_FAULT_STEPS": faults})

    def wait_ready(self, timeout: float = 900) -> None:
        """Until /health is 200 and the background warm-up has built every step shape (its
        compilations would otherwise count as growth of memory and of time to first token)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if (requests.get(self.url + "/health", timeout=5).status_code == 200
                        and "\njaxserve_warmup_pending_step_shapes 0.0" in requests.get(self.url + "/metrics",
                                                                                       timeout=30).text):
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.log_tail()}")

    def sample(self) -> dict:
        """The gauges and counters the soak follows, and the server's resident memory in MiB."""
        text = requests.get(self.url + "/metrics", timeout=30).text
        m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        with open(f"/proc/{self.proc.pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return {"free_pages": m["jaxserve_kv_free_pages"], "running": m["jaxserve_num_sequences_running"],
                "waiting": m["jaxserve_num_sequences_waiting"], "failed_steps": m["jaxserve_failed_steps_total"],
                "preemptions": m["jaxserve_num_preemptions_total"],
                "multi_step_decodes": m["jaxserve_multi_step_decodes_total"], "rss_mib": rss_kib / 1024}

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-n:]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(180)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def soak(server: Server, args) -> dict:
    t0 = time.monotonic()
    start = {**server.sample(), "t": 0.0}
    samples, results = [start], []
    end = t0 + args.duration
    done = threading.Event()

    def sampler():
        while not done.wait(1.0):
            samples.append({**server.sample(), "t": time.monotonic() - t0})

    def client(i: int):
        c = Client(server.url, VOCAB_SIZE, args.seed * 1000 + i, t0, first=2 * i)
        while time.monotonic() < end:
            results.append(c.one())

    load = [load_average()]
    watcher = threading.Thread(target=sampler, daemon=True)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(client, range(args.clients)))
    # Settle: requests of clients that left are aborted at the server's next look.
    settle_end = time.monotonic() + 30
    while time.monotonic() < settle_end and (samples[-1]["running"] or samples[-1]["waiting"]):
        time.sleep(0.5)
    done.set()
    watcher.join()
    final = {**server.sample(), "t": time.monotonic() - t0}
    load.append(load_average())
    return {"duration_s": args.duration, "clients": args.clients, "fault_every": args.fault_every,
            "load_avg": load, "start": start, "final": final, "samples": samples,
            "requests": [vars(r) for r in results]}


def checks(report: dict) -> list[dict]:
    """Pass or fail, with the figure, for a run's report (its result and the engine it ran)."""
    reqs, samples, d = report["requests"], report["samples"], report["duration_s"]
    outcomes = collections.Counter(r["outcome"] for r in reqs)
    lost = [r for r in reqs if r["outcome"].startswith("LOST")]
    fifth = d / 5
    rss_warm = next(s["rss_mib"] for s in samples if s["t"] >= fifth)
    rss_peak = max(s["rss_mib"] for s in samples if s["t"] >= fifth)
    ttfts = _ttfts(reqs)
    first = percentiles([t for s, t in ttfts if s < fifth])["p99"]
    last = percentiles([t for s, t in ttfts if s >= d - fifth])["p99"]
    faults = report["final"]["failed_steps"] - report["start"]["failed_steps"]
    preempted = report["final"]["preemptions"] - report["start"]["preemptions"]
    multi = report["final"]["multi_step_decodes"] - report["start"]["multi_step_decodes"]
    stepped = [{"check": "multi-step decodes ran (decode_steps > 1)", "ok": multi > 0, "value": f"{multi:g}"}
               ] if report["engine"]["decode_steps"] > 1 else []
    return stepped + [
        {"check": "every accepted request ended with full output or a clear error",
         "value": f"{len(lost)} lost of {len(reqs)}" + (f" (first: {lost[0]['outcome']})" if lost else ""),
         "ok": not lost},
        {"check": "free KV pages back to the start",
         "ok": report["final"]["free_pages"] == report["start"]["free_pages"],
         "value": f"{report['start']['free_pages']:g} -> {report['final']['free_pages']:g}"},
        {"check": f"RSS growth after warm-up < {MAX_RSS_GROWTH:.0%}", "ok": rss_peak < rss_warm * (1 + MAX_RSS_GROWTH),
         "value": f"{rss_warm:.0f} -> peak {rss_peak:.0f} MiB ({rss_peak / rss_warm - 1:+.1%})"},
        {"check": TTFT_CHECK,
         "ok": first is not None and last is not None and last <= MAX_TTFT_RATIO * first,
         "value": " -> ".join("no samples" if v is None else f"{v:.0f} ms" for v in (first, last))},
        {"check": "engine faults injected and failed cleanly", "ok": faults > 0 and outcomes["engine_error"] > 0,
         "value": f"{faults:g} failed steps, {outcomes['engine_error']} requests failed"},
        {"check": "long prompts forced preemption", "ok": preempted > 0, "value": f"{preempted:g} preemptions"},
        {"check": "the server exits 0 on SIGTERM afterwards", "ok": report.get("exit_code") == 0,
         "value": str(report.get("exit_code"))},
    ]


def _ttfts(reqs: list[dict]) -> list[tuple[float, float]]:
    """(send time, TTFT) of the short-prompt streams that ran to their end. Long prompts are left
    out: their TTFT is their own 20-30 prefill steps, recomputed when preempted, by design."""
    return [(r["sent"], r["ttft"]) for r in reqs
            if r["ttft"] is not None and r["outcome"] == "ok" and r["kind"] in TTFT_KINDS]


def windows(result: dict) -> tuple[list[float], list[float | None]]:
    """p99 TTFT (ms) per WINDOW_S window of send time."""
    edges = np.arange(0, result["duration_s"] + WINDOW_S, WINDOW_S)
    ttfts = _ttfts(result["requests"])
    p99 = [percentiles([t for s, t in ttfts if a <= s < b])["p99"] for a, b in zip(edges[:-1], edges[1:])]
    return [float(a + WINDOW_S / 2) for a in edges[:-1]], p99


def markdown(report: dict) -> str:
    reqs = report["requests"]
    by_kind = collections.defaultdict(collections.Counter)
    for r in reqs:
        by_kind[r["kind"]][r["outcome"] if not r["outcome"].startswith("LOST") else "LOST"] += 1
    outcomes = ["ok", "engine_error", "timeout", "left", "rejected", "LOST"]
    lines = [f"# Soak: {report['duration_s']:g} s, {report['clients']} clients, a fault every "
             f"{report['fault_every']} steps", "", f"Command: `{report['command']}`  ",
             f"{machine_line(report['machine'])}  ", f"Load average: {report['load_avg'][0]:.1f} -> "
             f"{report['load_avg'][1]:.1f}; engine: `{report['engine']}`", "", "## Checks", ""]
    lines += markdown_table(["check", "result", "pass"], [[c["check"], c["value"], "yes" if c["ok"] else "**NO**"]
                                                          for c in report["checks"]])
    lines += ["", f"## Requests ({len(reqs)}, {len(reqs) / report['duration_s']:.1f}/s)", ""]
    lines += markdown_table(["kind", *outcomes], [[k, *(by_kind[k][o] for o in outcomes)] for k in KINDS],
                            right_aligned=tuple(range(1, len(outcomes) + 1)))
    ttft = percentiles([t for _, t in _ttfts(reqs)])
    lines += ["", "TTFT of the short-prompt streams that ran to their end (ms): "
              + ", ".join(f"{k} {v:.0f}" for k, v in ttft.items() if v is not None), "",
              f"![p99 TTFT, free pages and resident memory over time]({report['plot']})", ""]
    lost = [r for r in reqs if r["outcome"].startswith("LOST")]
    if lost:   # when each was sent, and what the engine held meanwhile, beside the server's log
        lines += ["## LOST", ""] + [f"- {r['kind']} sent at {r['sent']:.1f} s: {r['outcome']}" for r in lost]
        lines += ["", "Engine (t s: running, waiting, free pages): " + ", ".join(
            f"{s['t']:.0f}: {s['running']:g}, {s['waiting']:g}, {s['free_pages']:g}" for s in report["samples"][::5]),
            "", "```", report.get("server_log", ""), "```", ""]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    centers, p99 = windows(report)
    axes[0].plot(centers, [v if v is not None else np.nan for v in p99], marker="o")
    axes[0].set_ylabel(f"p99 TTFT (ms, {WINDOW_S} s windows)")
    t = [s["t"] for s in report["samples"]]
    axes[1].plot(t, [s["free_pages"] for s in report["samples"]])
    axes[1].set_ylabel("free KV pages")
    axes[2].plot(t, [s["rss_mib"] for s in report["samples"]])
    axes[2].set_ylabel("server RSS (MiB)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.axvline(report["duration_s"] / 5, color="grey", lw=0.8, ls="--")   # end of warm-up
        ax.grid(alpha=0.3)
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
