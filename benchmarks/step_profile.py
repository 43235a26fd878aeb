"""Where an engine step's time goes: the step's median wall time, then the profiler's view.
On XLA CPU: XLA's own op profile (`--xla_cpu_enable_xprof_traceme`) as self time per op kind,
split into ops inside a while loop (the XLA attention path's block and row-group loops) and ops
outside one; self time is summed over XLA's worker threads, so a multi-threaded dot counts once
per thread. On a GPU: the kernels on the GPU's streams, time per kernel name, and how much of a
step the GPU was busy at all (the rest is the host: scheduling, transfers, launches).

Decode: --rows sequences with --context-token prompts, timed once all of them decode.
Prefill: --prefill rows of --context fresh tokens per step (chunks of 256, 512-token steps).

  python -m benchmarks.step_profile --model 100m --rows 64 --context 400
  python -m benchmarks.step_profile --model 100m --prefill 2 --context 256
  python -m benchmarks.step_profile --model /tmp/jaxserve_gpu/llama-1b --dtype bfloat16   # a GPU
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true"

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import MODEL_NAMES, WORK_DIR, load_trace, prepare_model, print_gpu_profile  # noqa: E402
from jaxserve import roofline  # noqa: E402
from jaxserve.config import EngineConfig  # noqa: E402
from jaxserve.engine import LLMEngine  # noqa: E402
from jaxserve.sampling_params import SamplingParams


def engine_for(model_dir: str, dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype=dtype, max_model_len=768, page_size=16,
                                  enable_prefix_caching=False, num_pages=64 * 48, max_num_seqs=64,
                                  max_num_batched_tokens=512, prefill_chunk_size=256))


def add_requests(engine: LLMEngine, n: int, prompt_len: int, max_tokens: int, rng) -> None:
    for _ in range(n):
        engine.add_request(rng.integers(1, engine.model_cfg.vocab_size, prompt_len).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def timed_steps(engine: LLMEngine, n: int | None) -> list[float]:
    """Seconds of the next n steps (None: until nothing is left)."""
    times = []
    while engine.has_unfinished() and (n is None or len(times) < n):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def dot_flops(rows: int, hidden: int, out: int) -> float:
    """FLOP/s of XLA's f32 [rows, hidden] x [out, hidden]^T dot (a Linear of the step), the best of 20."""
    x, w = jnp.ones((rows, hidden), jnp.float32), jnp.ones((out, hidden), jnp.float32)
    dot = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    return 2 * rows * hidden * out / roofline.best_seconds(dot, x, w, iters=20)


def op_self_times(trace_dir: str) -> collections.Counter:
    """ns of self time per (op kind, inside a while loop) over XLA's CPU worker threads."""
    data = load_trace(trace_dir)
    totals = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):
                continue
            stack = []   # [start, end, name, time of children]

            def close():
                start, end, name, children = stack.pop()
                in_loop = any(parent[2].startswith("while") for parent in stack)
                totals[(re.sub(r"\.\d+", "", name), in_loop)] += end - start - children
                if stack:
                    stack[-1][3] += end - start

            events = sorted(((e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events),
                            key=lambda e: (e[0], -e[1]))
            for start, end, name in events:
                while stack and stack[-1][1] <= start:
                    close()
                stack.append([start, end, name, 0])
            while stack:
                close()
    return totals


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="100m", help=f"{MODEL_NAMES} or a model directory")
    p.add_argument("--rows", type=int, default=64, help="decoding sequences")
    p.add_argument("--prefill", type=int, default=0, help="profile prefill steps of this many fresh rows instead")
    p.add_argument("--context", type=int, default=400, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=15, help="timed steps")
    p.add_argument("--traced-steps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--work-dir", default=WORK_DIR)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    engine, rng = engine_for(prepare_model(args.model, args.work_dir), args.dtype), np.random.default_rng(0)
    if args.prefill:   # one untimed round compiles the step; each later step prefills fresh rows
        add_requests(engine, args.prefill, args.context, 1, rng)
        timed_steps(engine, None)
        add_requests(engine, args.prefill * (args.steps + args.traced_steps), args.context, 1, rng)
        what = f"prefill steps of {args.prefill} fresh rows x {args.context} tokens"
    else:
        # As long as the model allows: the first rows decode while the last prefill, and no row may
        # finish before the timed steps are over (a smaller batch is another compiled shape).
        add_requests(engine, args.rows, args.context, engine.max_model_len - args.context, rng)
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()
        timed_steps(engine, 3)
        what = f"decode steps of {args.rows} rows with ~{args.context} tokens of context"
    times = timed_steps(engine, args.steps)
    print(f"{what}: median {1e3 * statistics.median(times):.1f} ms, fastest {1e3 * min(times):.1f} ms "
          f"over {len(times)} steps")
    cfg, rows = engine.model_cfg, args.prefill * args.context or args.rows
    print(f"ceilings: XLA's dot [{rows}, {cfg.hidden_size}] x [{cfg.intermediate_size}, {cfg.hidden_size}]^T "
          f"{dot_flops(rows, cfg.hidden_size, cfg.intermediate_size) / 1e9:.0f} GFLOP/s; 2048^2 matmul "
          f"{roofline.measure_matmul_flops(2048) / 1e9:.0f} GFLOP/s")
    trace_dir = tempfile.mkdtemp(prefix="jaxserve-trace-")
    jax.profiler.start_trace(trace_dir)
    traced_times = timed_steps(engine, args.traced_steps)
    jax.profiler.stop_trace()
    traced = len(traced_times)
    if jax.devices()[0].platform == "gpu":
        print_gpu_profile(trace_dir, traced, sum(traced_times), args.top)
        return
    totals = op_self_times(trace_dir)
    ops = sum(v for (name, _), v in totals.items() if not name.startswith("ThunkExecutor"))
    print(f"XLA op self time, all worker threads, traced (profiler on): {ops / 1e6 / traced:.1f} ms a step")
    print("| op kind | inside a while loop | ms a step | share |\n|---|---|---|---|")
    for (name, in_loop), ns in totals.most_common():
        if name.startswith("ThunkExecutor") or ns < ops / 1000:
            continue
        args.top -= 1
        print(f"| {name} | {'yes' if in_loop else 'no'} | {ns / 1e6 / traced:.2f} | {ns / ops:.1%} |")
        if not args.top:
            break


if __name__ == "__main__":
    main()
