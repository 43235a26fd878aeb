"""The hybrid KV cache (EngineConfig.hybrid_kv_cache, jaxserve/kv_groups.py) on and off, side by
side: the same workload through one engine per setting, in alternating rounds, in one process.

The model: a random Ministral-style checkpoint whose layers alternate full attention and a
64-token sliding window (gpt-oss's pattern), built once under --work-dir. The workload is
offline_throughput's (seeded random prompts, all submitted at once, greedy, ignore_eos). Both
engines get the same KV memory (kv_cache_mb: the hybrid pool's pages hold half the layers, so it
has twice the pages); per setting and pool: output tokens/s per round, the KV memory in use at its
peak, preemptions, and whether every output equals the first setting's.

  python -m benchmarks.hybrid_kv_cache --kv-mb 640,160 --rounds 2 --out benchmarks/results/hybrid_kv_cache_cpu.md
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

from benchmarks.common import make_workload, markdown_table, model_summary, publish, workload_args, workload_text
from benchmarks.offline_throughput import KVPeak, engine_config, run_engine
from jaxserve.engine import LLMEngine
from jaxserve.kv_cache import page_bytes_per_chip

WINDOW = 64
MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, sliding_window=WINDOW,
             layer_types=["full_attention", "sliding_attention"] * 4)


def prepare(work_dir: str) -> str:
    out_dir = os.path.join(work_dir, "ministral-sliding")
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        import torch
        import transformers as tf

        from benchmarks.common import save_word_tokenizer
        torch.manual_seed(0)
        tf.MinistralForCausalLM(tf.MinistralConfig(**MODEL)).save_pretrained(out_dir)
        save_word_tokenizer(out_dir, MODEL["vocab_size"])
    return out_dir


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kv-mb", default="640,160", help="KV pool sizes (MiB) to compare the settings at")
    p.add_argument("--rounds", type=int, default=2)
    workload_args(p, num_prompts=48, inputs=(128, 512), outputs=(64, 256))
    p.add_argument("--out", default=None, help="markdown file for the table (notes below the marker kept)")
    args = p.parse_args(argv)
    model_dir = prepare(args.work_dir)
    rows = []
    for mb in [int(x) for x in args.kv_mb.split(",")]:
        engines, warmups = {}, {}
        for hybrid in (False, True):
            ecfg = dataclasses.replace(engine_config(model_dir, args), num_pages=None, kv_cache_mb=mb,
                                       hybrid_kv_cache=hybrid)
            engines[hybrid] = LLMEngine(ecfg)
            t0 = time.perf_counter()
            engines[hybrid].warmup()
            warmups[hybrid] = time.perf_counter() - t0
        requests = make_workload(args.num_prompts, (args.min_input, args.max_input),
                                 (args.min_output, args.max_output), MODEL["vocab_size"], args.seed)
        runs, peaks = {False: [], True: []}, {}
        for r in range(args.rounds):
            for hybrid in (False, True) if r % 2 == 0 else (True, False):
                peaks[hybrid] = KVPeak()
                runs[hybrid].append(run_engine(f"hybrid {hybrid}", engines[hybrid], requests, kv=peaks[hybrid]))
                print(f"{mb} MiB round {r + 1} hybrid {hybrid}: {runs[hybrid][-1].tokens_per_s:.0f} tok/s", flush=True)
        first = runs[False][-1].outputs
        for hybrid in (False, True):
            e = engines[hybrid]
            best = max(runs[hybrid], key=lambda run: run.tokens_per_s)
            page_bytes = page_bytes_per_chip(e.runner.cfg, e.dtype, e.ecfg.page_size, 1, False, groups=e.runner.kv_groups)
            rows.append([mb, "on" if hybrid else "off", f"{e.runner.num_pages} x {page_bytes // 1024} KiB",
                         f"{warmups[hybrid]:.1f}", ", ".join(f"{run.tokens_per_s:.0f}" for run in runs[hybrid]),
                         f"{best.tokens_per_s / max(run.tokens_per_s for run in runs[False]):.2f}x",
                         f"{peaks[hybrid].pages * page_bytes / 2**20:.1f}", e.scheduler.num_preemptions,
                         "yes" if best.outputs == first else f"{sum(a == b for a, b in zip(best.outputs, first))} of {len(first)}"])
    return publish(
        "Hybrid KV cache on and off", "hybrid_kv_cache", argv, args.out,
        f"Model: {model_summary(model_dir)}; layers alternate full attention and a {WINDOW}-token window. "
        f"{workload_text(args)}, {args.max_num_batched_tokens} tokens a step, pages of 16 tokens.", "",
        *markdown_table(["KV pool MiB", "hybrid", "pages", "warm-up s", "output tok/s per round", "best / off's best",
                         "KV MiB in use at peak (last round)", "preemptions (all rounds)", "outputs equal off's"],
                        rows))


if __name__ == "__main__":
    main()
