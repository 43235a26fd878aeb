"""Serving benchmark: an async streaming client for any OpenAI-compatible /v1/completions server.

Requests arrive as a Poisson process at --request-rate (or each rate of a --rates sweep, with the
same seeded prompts). Input and output lengths are lognormal, clipped (a long tail, as in real
traffic); prompts are words of Python's own documentation (pydoc_data) or random token ids, so
nothing is downloaded. Every request streams (`stream: true`, `ignore_eos: true`, usage in the
last chunk). Per request: TTFT (send to first text chunk), TPOT ((latency - TTFT) / (output
tokens - 1)), ITL (gaps between text chunks), end-to-end latency. Per rate: request and output
token throughput, and goodput: requests/s that meet both --slo-ttft-ms and --slo-tpot-ms.
When the server has a Prometheus /metrics, its counters' deltas and utilization gauges are
reported beside the client's figures.

  python -m benchmarks.serve_bench --rates 0.5,1,2,4 --num-prompts 100 --prompt-kind ids --vocab-size 400
  python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --request-rate 2

Writes <out>.json, <out>.md and <out>.png (latency and goodput against rate).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import os
import re
import socket
import sys
import time
import urllib.parse

import numpy as np

from benchmarks.common import (load_average, load_change, machine_line, markdown_table, percentiles, pyplot,
                               report_header, save_figure, write_report)


# ---- workload ----
@dataclasses.dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    input_len: int          # words (text prompts) or tokens (id prompts)
    max_tokens: int


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi: int) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(math.log(median), sigma, n)), lo, hi).astype(int)


def make_requests(n: int, seed: int, kind: str, input_median: float, input_sigma: float, max_input: int,
                  output_median: float, output_sigma: float, max_output: int,
                  vocab_size: int | None = None) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = lognormal_lengths(rng, n, input_median, input_sigma, 1, max_input)
    outs = lognormal_lengths(rng, n, output_median, output_sigma, 1, max_output)
    if kind == "ids":
        if not vocab_size:
            raise ValueError("--prompt-kind ids needs --vocab-size")
        # Ids 0-2 are left out: unk/bos/eos in most vocabularies.
        prompts = [rng.integers(3, vocab_size, m).tolist() for m in ins]
    else:
        words = _doc_words()
        starts = rng.integers(0, len(words) - max_input, n)
        prompts = [" ".join(words[s:s + m]) for s, m in zip(starts, ins)]
    return [BenchRequest(p, int(m), int(o)) for p, m, o in zip(prompts, ins, outs)]


def add_length_arguments(p: argparse.ArgumentParser, input_median: float, max_input: int, output_median: float,
                         max_output: int) -> None:
    """make_requests' lognormal lengths as flags: medians, sigmas and the maxima they are clipped to."""
    p.add_argument("--input-median", type=float, default=input_median)
    p.add_argument("--input-sigma", type=float, default=0.8)
    p.add_argument("--max-input", type=int, default=max_input)
    p.add_argument("--output-median", type=float, default=output_median)
    p.add_argument("--output-sigma", type=float, default=0.8)
    p.add_argument("--max-output", type=int, default=max_output)


def _doc_words() -> list[str]:
    from pydoc_data.topics import topics

    return [w for w in re.findall(r"[A-Za-z][A-Za-z'-]*[.,]?", " ".join(topics[k] for k in sorted(topics)))]


def arrival_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """Poisson arrivals: seconds from the start, exponential gaps of mean 1/rate (all 0 at inf)."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


# ---- one request ----
@dataclasses.dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0                       # seconds
    latency: float = 0.0
    chunk_gaps: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def send(session, url: str, payload: dict) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now = time.perf_counter()
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.chunk_gaps.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        if last is None:
            res.ttft = res.latency          # no text at all: the first token came with the end
        if not res.output_tokens:           # no usage chunk: count text chunks
            res.output_tokens = len(res.chunk_gaps) + (last is not None)
        res.ok = True
    except Exception as e:  # a benchmark reports failures, it does not stop on them
        res.error = f"{type(e).__name__}: {e}"[:200]
    return res


def payload(req: BenchRequest, model: str, ignore_eos: bool) -> dict:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body


# ---- one rate ----
async def run_rate(base_url: str, model: str, requests: list[BenchRequest], rate: float, args) -> tuple[list, float]:
    """Send every request at its arrival time (those due after --duration-limit are not sent);
    returns the results and the wall time from the first send to the last completion."""
    import aiohttp
    from tqdm import tqdm

    offsets = arrival_offsets(len(requests), rate, args.seed)
    due = [(o, r) for o, r in zip(offsets, requests) if o <= args.duration_limit]
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    url = base_url + "/v1/completions"
    bar = tqdm(total=len(due), desc=f"rate {rate:g}/s", unit="req", file=sys.stderr)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        start = time.perf_counter()

        async def one(offset, req):
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            res = await send(session, url, payload(req, model, args.ignore_eos))
            bar.update(1)
            return res

        results = await asyncio.gather(*(one(o, r) for o, r in due))
        duration = time.perf_counter() - start
    bar.close()
    return results, duration


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if r.ttft * 1e3 <= slo_ttft_ms and r.tpot * 1e3 <= slo_tpot_ms]
    errors = [r.error for r in results if not r.ok]
    return {
        "sent": len(results), "completed": len(ok), "failed": len(errors), "first_error": errors[0] if errors else None,
        "duration_s": duration,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration, "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "goodput": len(good) / duration, "slo_attainment": len(good) / len(results) if results else 0.0,
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": percentiles([g for r in ok for g in r.chunk_gaps]), "e2e_ms": percentiles([r.latency for r in ok]),
    }


# ---- the server's own view ----
def scrape(base_url: str) -> dict[str, float] | None:
    """Prometheus samples of /metrics by name (labels folded into the name); None without one."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = requests.get(base_url + "/metrics", timeout=30)
    except requests.RequestException:
        return None
    if r.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def server_view(before: dict | None, after: dict | None) -> dict:
    """Counter deltas (names ending in _total) and utilization gauges over one rate's run."""
    if before is None or after is None:
        return {}
    view = {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith("_total")}
    view.update({k: v for k, v in after.items() if "utilization" in k})
    return view


# ---- output ----
def markdown(report: dict) -> str:
    a = report["args"]
    lines = [f"# Serving benchmark: {report['model']} at {report['base_url']}", "",
             *([f"Server: {a['label']}", ""] if a["label"] else []), f"`{report['command']}`", "",
             f"{report['date']}. {a['num_prompts']} requests per rate, Poisson arrivals, seed {a['seed']}; "
             f"prompts: {a['prompt_kind']}, input lognormal(median {a['input_median']}, sigma {a['input_sigma']}) "
             f"clipped to {a['max_input']}; output lognormal(median {a['output_median']}, sigma "
             f"{a['output_sigma']}) clipped to {a['max_output']}; ignore_eos {a['ignore_eos']}. "
             f"SLO: TTFT <= {a['slo_ttft_ms']:g} ms and TPOT <= {a['slo_tpot_ms']:g} ms.", "",
             machine_line(report["machine"]), ""]
    lines += markdown_table(
        ["rate (req/s)", "done/sent", "req/s", "out tok/s", "goodput (req/s)", "SLO met", "TTFT p50 / p99 (ms)",
         "TPOT p50 / p99 (ms)", "ITL p50 / p99 (ms)", "E2E p50 / p90 / p99 (ms)", "load avg"],
        [_rate_row(run) for run in report["runs"]])
    if any(run["server"] for run in report["runs"]):
        lines += ["", "Server's /metrics over each rate (counter deltas, utilization gauges at the end):", ""]
        rows = [[f"{run['rate']:g}", *(_fmt(run["server"].get(k)) for k in _SERVER_KEYS)] for run in report["runs"]]
        lines += markdown_table(["rate", *_SERVER_KEYS], rows)
    errors = [(run["rate"], run["summary"]["first_error"]) for run in report["runs"] if run["summary"]["first_error"]]
    lines += [""] + [f"First error at rate {r:g}: `{e}`" for r, e in errors]
    return "\n".join(lines) + "\n"


def _rate_row(run: dict) -> list[str]:
    s = run["summary"]
    f = lambda x: "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"  # noqa: E731
    return [f"{run['rate']:g}", f"{s['completed']}/{s['sent']}", f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}", f"{s['goodput']:.2f}", f"{100 * s['slo_attainment']:.0f}%",
            f"{f(s['ttft_ms']['p50'])} / {f(s['ttft_ms']['p99'])}", f"{f(s['tpot_ms']['p50'])} / {f(s['tpot_ms']['p99'])}",
            f"{f(s['itl_ms']['p50'])} / {f(s['itl_ms']['p99'])}",
            f"{f(s['e2e_ms']['p50'])} / {f(s['e2e_ms']['p90'])} / {f(s['e2e_ms']['p99'])}", load_change(run["load_avg"])]


_SERVER_KEYS = ("jaxserve_prompt_tokens_total", "jaxserve_generation_tokens_total",
                "jaxserve_model_bandwidth_utilization", "jaxserve_model_flops_utilization")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def plot(report: dict, path: str) -> None:
    runs = report["runs"]
    rates = [r["rate"] for r in runs]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        for pct, style in (("p50", "-o"), ("p99", "--s")):
            ax1.plot(rates, [r["summary"][key][pct] for r in runs], style, label=f"{label} {pct}")
    ax1.set(xlabel="request rate (req/s)", ylabel="latency (ms)", yscale="log", title="Latency")
    ax1.legend(fontsize=7, ncol=3)
    ax2.plot(rates, [r["summary"]["request_throughput"] for r in runs], "-o", label="throughput")
    ax2.plot(rates, [r["summary"]["goodput"] for r in runs], "-s", label="goodput (meets SLO)")
    ax2.plot(rates, rates, ":", color="gray", label="offered rate")
    a = report["args"]
    ax2.set(xlabel="request rate (req/s)", ylabel="requests/s",
            title=f"Goodput (TTFT <= {a['slo_ttft_ms']:g} ms, TPOT <= {a['slo_tpot_ms']:g} ms)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: {report['machine'].get('cpu', '')}", fontsize=9)
    save_figure(fig, path)


# ---- driver ----
def check_loopback(base_url: str, allow_remote: bool) -> None:
    host = urllib.parse.urlparse(base_url).hostname or ""
    addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    if not allow_remote and not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise SystemExit(f"serve_bench: {host} is not a loopback address (pass --allow-remote to benchmark it)")


def served_model(base_url: str) -> str:
    import requests

    r = requests.get(base_url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run(args) -> dict:
    """The whole benchmark; returns the report (also written to --out .json/.md/.png)."""
    base_url = args.base_url.rstrip("/")
    check_loopback(base_url, args.allow_remote)
    model = args.model or served_model(base_url)
    rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.request_rate]
    requests_ = make_requests(args.num_prompts, args.seed, args.prompt_kind, args.input_median, args.input_sigma,
                              args.max_input, args.output_median, args.output_sigma, args.max_output,
                              args.vocab_size)
    command = " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])
    report = {"model": model, "base_url": base_url, **report_header(command, args), "runs": []}
    for rate in rates:
        before, load0 = scrape(base_url), load_average()
        results, duration = asyncio.run(run_rate(base_url, model, requests_, rate, args))
        summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        report["runs"].append({"rate": rate, "summary": summary, "server": server_view(before, scrape(base_url)),
                               "load_avg": [load0, load_average()]})
    if args.out:
        write_report(args.out, report, markdown, plot)
    print(markdown(report))
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", help="the 'model' field (default: the first of the server's /v1/models)")
    p.add_argument("--allow-remote", action="store_true", help="benchmark a server that is not on loopback")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (inf: all at once)")
    p.add_argument("--rates", help="comma-separated rates to sweep, e.g. 0.5,1,2,4 (overrides --request-rate)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-kind", choices=["text", "ids"], default="text",
                   help="text: words of Python's docs (lengths in words); ids: random token ids (needs --vocab-size)")
    p.add_argument("--vocab-size", type=int)
    add_length_arguments(p, input_median=64, max_input=512, output_median=48, max_output=256)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000)
    p.add_argument("--slo-tpot-ms", type=float, default=100)
    p.add_argument("--duration-limit", type=float, default=300, help="per rate: arrivals after this are not sent")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--label", default="", help="how the server was started, for the report")
    p.add_argument("--out", help="output path without extension, e.g. benchmarks/results/serve_tiny_cpu")


def cli(args) -> int:
    run(args)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return cli(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
