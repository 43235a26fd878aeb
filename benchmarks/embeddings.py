"""Embedding throughput: jaxserve's pooling runner (LLM.embed) against transformers as
sentence-transformers drives it (prompts sorted by length, right-padded batches, the last real
token's final hidden state, normalized), on the same weights and prompts, in one run.

The peer is what a CPU user would otherwise run: AutoModel in torch float32 with torch threads =
cores. Prompt tokens per second, the best of --rounds alternating rounds (warm-up and compilation
excluded), and the largest difference between the two systems' embeddings.

  python -m benchmarks.embeddings [--model 100m] [--num-prompts 256] [--out benchmarks/results/embeddings_cpu.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from benchmarks.common import (load_average, make_workload, markdown_table, model_summary, prepare_model, publish,
                               workload_args)
from benchmarks.offline_throughput import engine_config
from jaxserve import LLM


def transformers_embed(model, prompts: list[list[int]], batch_size: int) -> list[np.ndarray]:
    """sentence-transformers' loop: by length, right-padded batches, the last token's state."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out = [None] * len(prompts)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = [prompts[i] for i in order[start:start + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([p + [0] * (width - len(p)) for p in batch])
            mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in batch])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(batch)), mask.sum(1) - 1]
            for i, v in zip(order[start:start + batch_size], torch.nn.functional.normalize(last, dim=-1)):
                out[i] = v.numpy()
    return out


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def main(argv=None) -> str:
    import torch
    import transformers as tf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="100m", help="tiny, 100m or a model directory")
    p.add_argument("--batch-size", type=int, default=32, help="the peer's batch (sentence-transformers' default)")
    p.add_argument("--rounds", type=int, default=2)
    workload_args(p, num_prompts=256, inputs=(16, 512), outputs=(1, 1))
    p.add_argument("--out", default=None, help="markdown file for the table (notes below the marker kept)")
    args = p.parse_args(argv)
    torch.set_num_threads(os.cpu_count())
    model_dir = prepare_model(args.model, args.work_dir)
    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_config(model_dir, args), runner="pooling")))
    llm.llm_engine.warmup()
    peer = tf.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [r.prompt_token_ids for r in make_workload(args.num_prompts, (args.min_input, args.max_input), (1, 1),
                                                          llm.llm_engine.model_cfg.vocab_size, args.seed)]
    tokens, load = sum(map(len, prompts)), [load_average()]
    rates = {"jaxserve LLM.embed": [], f"transformers AutoModel, batches of {args.batch_size}": []}
    for r in range(args.rounds):
        for system in rates if r % 2 == 0 else list(rates)[::-1]:
            if system.startswith("jaxserve"):
                seconds, ours = timed(lambda: [np.array(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False)])
            else:
                seconds, theirs = timed(lambda: transformers_embed(peer, prompts, args.batch_size))
            rates[system].append(tokens / seconds)
            print(f"round {r + 1} {system}: {rates[system][-1]:.0f} prompt tok/s", flush=True)
    load.append(load_average())
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    best = {s: max(v) for s, v in rates.items()}
    peer_best = list(best.values())[1]
    rows = [[s, ", ".join(f"{x:.0f}" for x in rates[s]), f"{best[s] / peer_best:.2f}x"] for s in rates]
    return publish(
        "Embedding throughput: jaxserve's pooling runner vs transformers", "embeddings", argv, args.out,
        f"Model: {model_summary(model_dir)}; LAST-token pooling, normalized, float32 on both sides. "
        f"{args.num_prompts} prompts of seeded random ids, {args.min_input}-{args.max_input} tokens ({tokens:,} in all), "
        f"all submitted at once; jaxserve max_num_seqs {args.max_num_seqs}, {args.max_num_batched_tokens}-token steps, "
        f"chunks of {args.prefill_chunk_size}. Load average {load[0]:.1f} -> {load[1]:.1f}. Largest difference "
        f"between the two systems' embeddings: {diff:.1e}.", "",
        *markdown_table(["system", "prompt tokens/s per round", "best / transformers"], rows, (1, 2)))


if __name__ == "__main__":
    main()
