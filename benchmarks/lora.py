"""Multi-LoRA decode throughput side by side (jaxserve/lora.py): the same workload through one
engine without LoRA and one serving `--adapters` random adapters of rank `--rank` on every
projection, in alternating rounds, in one process.

Rows: the engine without LoRA; the LoRA engine with every row on the base model (the stacks'
cost alone: a base row's mask is zero, its products computed like the others), every row on
adapter 1, and rows spread round-robin over the base model and each adapter (mixed: every step
holds them all). Each LoRA Linear adds two products through max_loras x max_lora_rank columns;
the report gives that share of the base model's Linear FLOPs beside the slowdown. The workload is offline_throughput's
(seeded random prompts, all submitted at once, greedy, ignore_eos) with short prompts and long
outputs, so decode steps dominate; per round: output tokens/s and ms per decode step.

  python -m benchmarks.lora --model 100m --adapters 4 --rank 16 --rounds 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
from safetensors.numpy import save_file

from benchmarks.common import (load_average, make_workload, markdown_table, model_summary, prepare_model, publish,
                               workload_args, workload_text)
from benchmarks.offline_throughput import engine_config
from jaxserve import lora
from jaxserve.config import ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def save_random_adapter(model_dir: str, out_dir: str, rank: int, seed: int) -> str:
    """A PEFT-format adapter of rank `rank` on every projection of the model, seeded random weights."""
    cfg = ModelConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, rows, (out, inp) in lora.linear_modules(cfg).values():
        assert rows is None, "a model with fused projections"
        name = f"{lora.PEFT_PREFIX}{module}.lora_"
        tensors[name + "A.weight"] = rng.normal(0, inp ** -0.5, (rank, inp)).astype(np.float32)
        tensors[name + "B.weight"] = rng.normal(0, 0.02, (out, rank)).astype(np.float32)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return out_dir


def run(engine: LLMEngine, requests, names: list[str | None]) -> tuple[float, float]:
    """All requests at once, request i on adapter names[i % len(names)]: (output tokens/s, ms per
    decode step)."""
    for i, r in enumerate(requests):
        engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                              ignore_eos=True, lora_name=names[i % len(names)]))
    decode_s, decode_steps, t0 = 0.0, 0, time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        if not engine.last_schedule.num_prefill_seqs:
            decode_s, decode_steps = decode_s + time.perf_counter() - t, decode_steps + 1
    seconds = time.perf_counter() - t0
    return sum(r.max_tokens for r in requests) / seconds, 1e3 * decode_s / max(decode_steps, 1)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, 100m or a model directory")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    workload_args(p, num_prompts=64, inputs=(16, 32), outputs=(64, 128))
    p.add_argument("--out", default=None, help="markdown file for the table (notes below the marker kept)")
    args = p.parse_args(argv)
    model_dir = prepare_model(args.model, args.work_dir)
    names = [f"adapter{i + 1}" for i in range(args.adapters)]
    modules = {n: save_random_adapter(model_dir, os.path.join(args.work_dir, "lora", n), args.rank, i)
               for i, n in enumerate(names)}
    plain = engine_config(model_dir, args)
    engines = {"no LoRA": LLMEngine(plain),
               "LoRA": LLMEngine(dataclasses.replace(plain, lora_modules=modules, max_lora_rank=args.rank))}
    for engine in engines.values():
        engine.warmup()
    requests = make_workload(args.num_prompts, (args.min_input, args.max_input), (args.min_output, args.max_output),
                             engines["LoRA"].model_cfg.vocab_size, args.seed)
    cases = {"no LoRA engine": ("no LoRA", [None]), "LoRA engine, base rows": ("LoRA", [None]),
             "LoRA engine, all rows on adapter1": ("LoRA", names[:1]),
             f"LoRA engine, mixed base + {args.adapters} adapters": ("LoRA", [None, *names])}
    runs, load = {case: [] for case in cases}, [load_average()]
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else list(cases)[::-1]:
            engine, rows = cases[case]
            runs[case].append(run(engines[engine], requests, rows))
            print(f"round {r + 1} {case}: {runs[case][-1][0]:.0f} tok/s, {runs[case][-1][1]:.2f} ms/decode step",
                  flush=True)
    load.append(load_average())
    shapes = [shape for _, _, shape in lora.linear_modules(engines["LoRA"].model_cfg).values()]
    base_flops = sum(out * inp for out, inp in shapes)
    lora_flops = sum(args.adapters * args.rank * (out + inp) for out, inp in shapes)
    first = max(t for t, _ in runs["no LoRA engine"])
    rows = [[case, ", ".join(f"{t:.0f}" for t, _ in runs[case]), f"{max(t for t, _ in runs[case]) / first:.2f}x",
             f"{min(ms for _, ms in runs[case]):.2f}"] for case in cases]
    return publish(
        "Multi-LoRA decode throughput", "lora", argv, args.out,
        f"Model: {model_summary(model_dir)}. {args.adapters} random adapters of rank {args.rank} on every projection "
        f"(max_loras {args.adapters}: {args.adapters * args.rank} LoRA columns a Linear, {lora_flops / base_flops:.1%} "
        f"of the decoder's Linear FLOPs). {workload_text(args)}. Load average {load[0]:.1f} -> {load[1]:.1f} "
        f"(a busy neighbour slows some rounds: compare rounds, not only the best).", "",
        *markdown_table(["rows", "output tok/s per round", "best / no LoRA", "best ms per decode step"], rows))


if __name__ == "__main__":
    main()
