"""Batching strategies on one engine and one arrival trace: static, dynamic and continuous.

One warmed-up LLMEngine (in-process) serves the same seeded Poisson trace three times; only the
driver around add_request / step differs, the engine always steps at full speed:
  static      wait for a full batch of B requests (the last one may be short), run it to
              completion, then take the next B.
  dynamic     when the engine is idle, dispatch the waiting requests (up to N) as soon as N have
              arrived or the oldest has waited T ms; run them to completion.
  continuous  each request goes to the engine on arrival; the scheduler admits it at the next
              step, beside the running decodes (chunked prefill).
Static and dynamic batches are fixed batches, as in a server without iteration-level scheduling
(transformers `generate`, FasterTransformer): every row keeps decoding until the batch's longest
request is done, and the batch's results return together when it ends. A request counts only
its own tokens. Latencies count from the trace arrival, so time held back in the driver counts. Throughput is
over first arrival -> last finish. MBU / MFU: the ideal bytes and FLOPs of every step
(jaxserve/roofline.py) over the time spent stepping, against this machine's peaks measured in
the same run (CPU) or the datasheet (GPU/TPU).

  python -m benchmarks.batching_strategies --models tiny --rate 11 --num-requests 300 --out benchmarks/results/batching_cpu_tiny
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from benchmarks.common import (MODEL_NAMES, RESULTS_DIR, WORK_DIR, command_line, load_average, load_change,
                               machine_line, markdown_table, measured_peaks, model_summary, percentiles,
                               prepare_model, pyplot, report_header, save_figure, timed_step, write_report)
from benchmarks.serve_bench import add_length_arguments, arrival_offsets, make_requests
from jaxserve import roofline
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Record:
    arrival: float
    first_token: float
    finish: float
    tokens: int


def static_policy(batch: int):
    def release(held: int, idle: bool, waited: float, more: bool) -> int:
        return min(held, batch) if idle and (held >= batch or (held and not more)) else 0
    return release


def dynamic_policy(batch: int, timeout_s: float):
    def release(held: int, idle: bool, waited: float, more: bool) -> int:
        ready = held >= batch or (held and (waited >= timeout_s or not more))
        return min(held, batch) if idle and ready else 0
    return release


def continuous_policy():
    def release(held: int, idle: bool, waited: float, more: bool) -> int:
        return held
    return release


def drive(engine: LLMEngine, trace: list, offsets: np.ndarray, release, cost: roofline.CostModel,
          fixed_batches: bool) -> dict:
    """Replay the trace in real time under a release policy; per-request records and step costs.
    fixed_batches: each release is one fixed batch (see the module docstring)."""
    start = time.monotonic()
    held: collections.deque = collections.deque()
    nxt, groups, finished, steps = 0, [], {}, []
    while nxt < len(trace) or held or engine.has_unfinished():
        now = time.monotonic() - start
        while nxt < len(trace) and offsets[nxt] <= now:
            held.append(nxt)
            nxt += 1
        waited = now - offsets[held[0]] if held else 0.0
        group = [held.popleft() for _ in range(release(len(held), not engine.has_unfinished(), waited,
                                                       nxt < len(trace)))]
        if group:
            groups.append(group)
            longest = max(trace[i].max_tokens for i in group)
            for i in group:
                max_tokens = longest if fixed_batches else trace[i].max_tokens
                engine.add_request(trace[i].prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True), str(i), start + offsets[i])
        if engine.has_unfinished():
            outputs, seconds, rows = timed_step(engine)
            steps.append((cost.step(rows), seconds, len(rows)))
            finished |= {int(o.request_id): o for o in outputs if o.finished}
        else:   # idle: until the next arrival, or poll while a dynamic batch is forming
            until = offsets[nxt] if nxt < len(trace) else now
            time.sleep(min(max(0.0, until - now), 0.001 if held else 1.0))
    records = []
    for group in groups:
        end = max(finished[i].finish_time for i in group)
        records += [Record(finished[i].arrival_time, finished[i].first_token_time,
                           end if fixed_batches else finished[i].finish_time, trace[i].max_tokens) for i in group]
    return {"records": records, "steps": steps, "end": time.monotonic() - start}


def summarize(run: dict, peaks: roofline.Peaks) -> dict:
    done = run["records"]
    span = max(r.finish for r in done) - min(r.arrival for r in done)
    tokens = sum(r.tokens for r in done)
    step_s = sum(t for _, t, _ in run["steps"])
    return {
        "requests": len(done), "output_tokens": tokens, "span_s": span,
        "request_throughput": len(done) / span, "output_throughput": tokens / span,
        "ttft_ms": percentiles([r.first_token - r.arrival for r in done]),
        "e2e_ms": percentiles([r.finish - r.arrival for r in done]),
        "steps": len(run["steps"]), "mean_batch": float(np.mean([n for *_, n in run["steps"]])),
        "mbu": sum(c.bytes for c, _, _ in run["steps"]) / step_s / peaks.bandwidth,
        "mfu": sum(c.flops for c, _, _ in run["steps"]) / step_s / peaks.flops,
    }


def run_model(args, name: str) -> dict:
    model_dir = prepare_model(name, args.work_dir)
    cfg = EngineConfig(model=model_dir, dtype="float32", max_model_len=args.max_input + args.max_output,
                       max_num_seqs=args.batch, max_num_batched_tokens=args.max_num_batched_tokens,
                       prefill_chunk_size=args.max_num_batched_tokens, max_prefill_seqs=args.max_prefill_seqs,
                       enable_prefix_caching=False)
    engine = LLMEngine(cfg)
    t0 = time.perf_counter()
    engine.warmup()
    print(f"{name}: warm-up {time.perf_counter() - t0:.0f}s; {model_summary(model_dir)}", file=sys.stderr)
    peaks = measured_peaks()
    cost = roofline.CostModel(engine.model_cfg, jnp.dtype(engine.dtype).itemsize)
    trace = make_requests(args.num_requests, args.seed, "ids", args.input_median, args.input_sigma, args.max_input,
                          args.output_median, args.output_sigma, args.max_output, engine.model_cfg.vocab_size)
    offsets = arrival_offsets(len(trace), args.rate, args.seed)
    policies = {"static": static_policy(args.batch), "dynamic": dynamic_policy(args.batch, args.timeout_ms / 1e3),
                "continuous": continuous_policy()}
    results = {}
    for strategy in args.strategies.split(","):
        load0 = load_average()
        run = drive(engine, trace, offsets, policies[strategy], cost, fixed_batches=strategy != "continuous")
        results[strategy] = summarize(run, peaks) | {"load_avg": [load0, load_average()]}
        s = results[strategy]
        print(f"{name} {strategy}: {s['request_throughput']:.2f} req/s, e2e p50 {s['e2e_ms']['p50']:.0f} "
              f"p99 {s['e2e_ms']['p99']:.0f} ms", file=sys.stderr)
    return {"model": name, "summary": model_summary(model_dir), "engine": {
                k: getattr(cfg, k) for k in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_seqs",
                                             "max_model_len", "dtype")},
            "peaks": dataclasses.asdict(peaks),
            "input_tokens": sum(r.input_len for r in trace), "output_tokens": sum(r.max_tokens for r in trace),
            "strategies": results}


def markdown(report: dict) -> str:
    a = report["args"]
    lines = ["# Batching strategies: static vs dynamic vs continuous on one engine", "",
             f"{report['date']}. `{report['command']}`", "",
             f"One trace per model: {a['num_requests']} requests, Poisson at {a['rate']:g} req/s (seed {a['seed']}), "
             f"input lognormal(median {a['input_median']:g}, sigma {a['input_sigma']:g}) <= {a['max_input']}, "
             f"output lognormal(median {a['output_median']:g}, sigma {a['output_sigma']:g}) <= {a['max_output']} "
             f"tokens (ignore_eos). static: batches of {a['batch']}; dynamic: up to {a['batch']} or "
             f"{a['timeout_ms']:g} ms; continuous: the scheduler (max_num_seqs {a['batch']}). "
             "Static and dynamic batches are fixed: every row decodes until the batch's longest request is "
             "done and the batch's results return together (a request counts only its own tokens). "
             "Throughput over first arrival -> last finish; latencies from arrival; TTFT is the first "
             "token's time, as streamed.", "",
             machine_line(report["machine"]), ""]
    for m in report["models"]:
        lines += [f"## {m['model']}: {m['summary']}", "",
                  f"Engine: {m['engine']}. Peaks: {m['peaks']['bandwidth'] / 1e9:.1f} GB/s, "
                  f"{m['peaks']['flops'] / 1e9:.1f} GFLOP/s ({m['peaks']['source']}).", ""]
        lines += markdown_table(
            ["strategy", "req/s", "out tok/s", "TTFT p50 / p99 (ms)", "E2E p50 / p99 (ms)", "steps", "mean batch",
             "MBU", "MFU", "load avg"],
            [[name, f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
              f"{s['ttft_ms']['p50']:.0f} / {s['ttft_ms']['p99']:.0f}",
              f"{s['e2e_ms']['p50']:.0f} / {s['e2e_ms']['p99']:.0f}", s["steps"], f"{s['mean_batch']:.1f}",
              f"{100 * s['mbu']:.1f}%", f"{100 * s['mfu']:.1f}%", load_change(s["load_avg"])]
             for name, s in m["strategies"].items()])
        st, co = m["strategies"].get("static"), m["strategies"].get("continuous")
        if st and co:
            lines += ["", f"Continuous vs static: E2E p99 {st['e2e_ms']['p99'] / co['e2e_ms']['p99']:.2f}x lower, "
                          f"throughput {co['output_throughput'] / st['output_throughput']:.2f}x."]
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    models = report["models"]
    fig, axes = pyplot().subplots(len(models), 2, figsize=(10, 3.6 * len(models)), squeeze=False)
    for (ax1, ax2), m in zip(axes, models):
        names = list(m["strategies"])
        x = np.arange(len(names))
        ax1.bar(x, [m["strategies"][n]["output_throughput"] for n in names], color="tab:blue")
        ax1.set(xticks=x, xticklabels=names, ylabel="output tokens/s", title=f"{m['model']}: throughput")
        for i, pct in enumerate(("p50", "p99")):
            ax2.bar(x + (i - 0.5) * 0.38, [m["strategies"][n]["e2e_ms"][pct] / 1e3 for n in names], 0.38,
                    label=f"E2E {pct}")
        ax2.set(xticks=x, xticklabels=names, ylabel="seconds", title=f"{m['model']}: latency")
        ax2.legend()
    fig.suptitle(f"Poisson {report['args']['rate']:g} req/s, {report['machine']['cpu']}", fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny", help=f"comma-separated, of {MODEL_NAMES}")
    p.add_argument("--strategies", default="static,dynamic,continuous")
    p.add_argument("--rate", type=float, default=20.0, help="Poisson arrivals, req/s")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=16, help="static/dynamic batch size = the engine's max_num_seqs")
    p.add_argument("--timeout-ms", type=float, default=500, help="dynamic batching: longest wait of the oldest request")
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-prefill-seqs", type=int, default=4)
    add_length_arguments(p, input_median=16, max_input=64, output_median=64, max_output=256)
    p.add_argument("--work-dir", default=WORK_DIR)
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "batching_cpu"), help="path without extension")
    args = p.parse_args(argv)
    report = report_header(command_line("batching_strategies", argv), args) | {
        "models": [run_model(args, name) for name in args.models.split(",")]}
    write_report(args.out, report, markdown, plot)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
