"""The host's share of a decode step: how long `engine.step()` takes when the model costs next to
nothing, so that the planning, packing, launching, collecting and detokenizing of B rows is all
that is left.

Why: on a GPU the overlapped loop hides the host's work only while the device's step takes longer.
On an H100 the embedded tiny model's decode step took 3.2 ms at 64 rows and the 1.1B model's
6.8 ms at 128 (benchmarks/results/engine_h100.md), about what this benchmark measures for the
host alone on the 2-core dev box: the host, not the GPU, set the pace of those steps.

The model: a seeded random 1-layer Llama (hidden 64, the embedded model's tokenizer and 4,096
vocabulary) written with save_pretrained. Per batch size B: B requests of 32 random prompt tokens,
greedy (`--penalties`: with a repetition and a presence penalty), ignore_eos; once all B decode
and `skip` more steps have run (the outputs' length when timing starts: host work that grows with
it shows), `steps` more tokens a row are timed: per
token of every row (one step of B tokens; `engine.step()` returns several with decode_steps > 1),
the wall time, the CPU time of the thread that ran `engine.step()` (the host's own work, without
the time XLA's threads took from it on a CPU "device"), the time it waited in `jax.device_get`
for the device (blocked: near zero here, the host is the bottleneck), and the wall time of its
calls into the tokenizer's decode_batch (detokenize).

Trees, and decode_steps settings, are compared side by side: the driver runs each (tree,
decode_steps) engine in its own process, in alternating order for `rounds` rounds, and keeps each
one's best round per B.

  python -m benchmarks.host_time --trees /tmp/base,. [--rows 16,64,128] [--rounds 3] [--skip 1700]
  python -m benchmarks.host_time --decode-steps 1,4,8
  python -m benchmarks.host_time --decode-steps 1,8 --penalties
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WORK_DIR = os.path.join("/tmp", "jaxserve-bench", "host-time")
MICRO = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])


def build_model(out_dir: str) -> None:
    import shutil

    import torch
    import transformers as tf
    from jaxserve.engine import TINY_MODEL_DIR

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**MICRO)).save_pretrained(out_dir)
    for name in os.listdir(TINY_MODEL_DIR):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(TINY_MODEL_DIR, name), out_dir)


def worker(rows: list[int], steps: int, skip: int, decode_steps: int, penalties: bool) -> dict:
    """This process's tree (PYTHONPATH): {B: [ms, host thread CPU ms, blocked ms, detokenize ms] a token step}."""
    import jax
    import numpy as np
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    spent = {"blocked": 0.0, "detokenize": 0.0}

    def timed(name, fn):
        def call(*args):
            t = time.perf_counter()
            out = fn(*args)
            spent[name] += time.perf_counter() - t
            return out
        return call

    wait, device_get = timed("blocked", jax.block_until_ready), jax.device_get
    jax.device_get = lambda x: device_get(wait(x))
    model = os.path.join(WORK_DIR, "micro")
    n = max(rows)
    max_len = max(512, 1 << (32 + skip + steps + 64 - 1).bit_length())
    engine = LLMEngine(EngineConfig(model=model, max_model_len=max_len, page_size=16, num_pages=n * max_len // 16 + 8,
                                    max_num_seqs=n, max_num_batched_tokens=1024,
                                    compilation_cache_dir=os.path.join(WORK_DIR, "cache"),
                                    **({"decode_steps": decode_steps} if decode_steps > 1 else {})))
    engine.warmup()
    engine.tokenizer.decode_batch = timed("detokenize", engine.tokenizer.decode_batch)
    rng = np.random.default_rng(0)
    out = {}
    for b in rows:
        params = SamplingParams(temperature=0.0, max_tokens=skip + steps + 64, ignore_eos=True,
                                **(dict(repetition_penalty=1.1, presence_penalty=0.5) if penalties else {}))
        ids = [engine.add_request(rng.integers(5, 4000, 32).tolist(), params) for _ in range(b)]
        while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
            engine.step()
        start = engine.stats["generation_tokens"]
        while engine.stats["generation_tokens"] - start < (5 + skip) * b:
            engine.step()
        spent.update(blocked=0.0, detokenize=0.0)
        start = engine.stats["generation_tokens"]
        t, c = time.perf_counter(), time.thread_time()
        while engine.stats["generation_tokens"] - start < steps * b:
            engine.step()
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        token_steps = (engine.stats["generation_tokens"] - start) / b
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        out[b] = [1e3 * x / token_steps for x in (wall, cpu, spent["blocked"], spent["detokenize"])]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trees", default=".", help="comma-separated jaxserve trees, compared side by side")
    p.add_argument("--rows", default="16,64,128")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", type=int, default=0, help="steps run before timing: outputs this long")
    p.add_argument("--decode-steps", default="1", help="comma-separated EngineConfig.decode_steps, side by side")
    p.add_argument("--penalties", action="store_true", help="every request penalised (repetition and presence)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.worker:
        print("RESULT " + json.dumps(worker(rows, args.steps, args.skip, int(args.decode_steps), args.penalties)))
        return
    if not os.path.exists(os.path.join(WORK_DIR, "micro", "model.safetensors")):
        build_model(os.path.join(WORK_DIR, "micro"))
    runs = [(os.path.abspath(t), k) for t in args.trees.split(",") for k in args.decode_steps.split(",")]
    best: dict[tuple, dict[int, list[float]]] = {run: {} for run in runs}
    for r in range(args.rounds):
        for tree, k in runs if r % 2 == 0 else runs[::-1]:
            env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--rows", args.rows,
                                  "--steps", str(args.steps), "--skip", str(args.skip), "--decode-steps", k]
                                 + ["--penalties"] * args.penalties,
                                 env=env, capture_output=True, text=True, check=True)
            result = json.loads(run.stdout.split("RESULT ", 1)[1])
            print(f"round {r + 1} {tree} decode_steps {k}: " + ", ".join(
                f"B={b} {w:.2f} ms (host thread {c:.2f}, blocked {x:.2f}, detokenize {d:.2f})"
                for b, (w, c, x, d) in result.items()), flush=True)
            for b, figures in result.items():
                if int(b) not in best[tree, k] or figures[0] < best[tree, k][int(b)][0]:
                    best[tree, k][int(b)] = figures
    print("\n| B | " + " | ".join(f"{t} k={k}: ms a token step (host thread CPU, blocked, detokenize ms)" for t, k in runs)
          + " | ratio | host CPU ratio |")
    print("|---|" + "---|" * (len(runs) + 2))
    for b in rows:
        first, last = best[runs[0]][b], best[runs[-1]][b]
        cells = [f"{w:.2f} ({c:.2f}, {x:.2f}, {d:.2f})" for w, c, x, d in (best[run][b] for run in runs)]
        print(f"| {b} | " + " | ".join(cells) + f" | {first[0] / last[0]:.2f}x | {first[1] / last[1]:.2f}x |")


if __name__ == "__main__":
    main()
