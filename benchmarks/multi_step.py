"""Multi-step decoding (EngineConfig.decode_steps) and the step shapes (EngineConfig.step_shapes)
side by side: the same workload through one engine per setting, in alternating rounds, in one
process.

Why: each engine step costs the host a fixed part (planning, packing, launching, collecting) that a
GPU's or TPU's decode step does not hide (benchmarks/results/host_time.md); with decode_steps k the
host pays it once per k tokens. On a CPU the XLA "device" shares the cores with the host, so the
figures here show the host's part only through the wall time.

The workload is offline_throughput's (seeded random prompts, all submitted at once, greedy,
ignore_eos), with its engine settings (no preemption, no prefix caching). Per setting: warm-up
(its compilations), output tokens/s per round, the host's ms per decode token step (launch to
collect, per device step), and whether every output equals the first setting's.

  python -m benchmarks.multi_step --model tiny --decode-steps 1,4,8 --rounds 2
  python -m benchmarks.multi_step --model tiny --decode-steps 1 --step-shapes all,largest

step_shapes largest compiles the largest decode and prefill shapes only and pads every batch into
them: a shorter warm-up, for padding in every step that is not full.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

from benchmarks.common import (make_workload, markdown_table, model_summary, prepare_model, publish, workload_args,
                               workload_text)
from benchmarks.offline_throughput import engine_config, run_engine
from jaxserve.engine import LLMEngine


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, 100m or a model directory")
    p.add_argument("--decode-steps", default="1,4,8")
    p.add_argument("--step-shapes", default="all", help="all, largest or both (all,largest)")
    p.add_argument("--rounds", type=int, default=2)
    workload_args(p, num_prompts=128, inputs=(16, 256), outputs=(64, 256))
    p.add_argument("--out", default=None, help="markdown file for the table (notes below the marker kept)")
    args = p.parse_args(argv)
    settings = list(itertools.product([int(k) for k in args.decode_steps.split(",")], args.step_shapes.split(",")))
    model_dir = prepare_model(args.model, args.work_dir)
    engines, warmups = {}, {}
    for k in settings:   # no executable store: each warm-up compiles what it builds
        engines[k] = LLMEngine(dataclasses.replace(engine_config(model_dir, args), decode_steps=k[0], step_shapes=k[1],
                                                   compilation_cache_dir=None))
        t0 = time.perf_counter()
        compiles = engines[k].warmup()
        warmups[k] = (time.perf_counter() - t0, compiles)
    requests = make_workload(args.num_prompts, (args.min_input, args.max_input), (args.min_output, args.max_output),
                             engines[settings[0]].model_cfg.vocab_size, args.seed)
    runs = {k: [] for k in settings}
    for r in range(args.rounds):
        for k in settings if r % 2 == 0 else settings[::-1]:
            runs[k].append(run_engine(label(k), engines[k], requests))
            print(f"round {r + 1} {label(k)}: {runs[k][-1].tokens_per_s:.0f} tok/s", flush=True)
    first = runs[settings[0]][-1].outputs
    rows = []
    for k in settings:
        best = max(runs[k], key=lambda run: run.tokens_per_s)
        rows.append([label(k), f"{warmups[k][0]:.1f} ({warmups[k][1]})", ", ".join(f"{run.tokens_per_s:.0f}" for run in runs[k]),
                     f"{best.tokens_per_s / max(r.tokens_per_s for r in runs[settings[0]]):.2f}x",
                     f"{best.profile.summary(best.seconds)['decode_step_ms']:.2f}",
                     "yes" if best.outputs == first else f"{sum(a == b for a, b in zip(best.outputs, first))} of {len(first)}"])
    return publish(
        "Multi-step decoding and step shapes", "multi_step", argv, args.out,
        f"Model: {model_summary(model_dir)}. {workload_text(args)}, {args.max_num_batched_tokens} tokens a step.", "",
        *markdown_table(["setting", "warm-up s (compilations)", "output tok/s per round", f"best / {label(settings[0])}",
                         "host ms per decode token step", f"outputs equal {label(settings[0])}'s"], rows))


def label(setting: tuple[int, str]) -> str:
    return f"decode_steps {setting[0]}, step_shapes {setting[1]}"


if __name__ == "__main__":
    main()
