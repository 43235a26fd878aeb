"""Would a `lax.scan` over the decoder layers pay on this machine? The embedded tiny model's real
step (jaxserve.runner, layers unrolled) beside the same weights stacked [L, ...] and scanned, with
the per-layer attention (jaxserve.models.llama.DecoderLayer, XLA path) unchanged. Two ways to hand
the scan the paged KV cache, stacked [L, pages, kv_heads, page_size, head_dim]:

  xs     the pools as the scan's xs/ys (each iteration gets its layer's slice, returns it)
  carry  the stacked pools in the carry, layer i read as pool[i] and written back with .at[i].set

Per step shape: lowering and compile seconds (no compilation cache), and the whole-pool copies
in the compiled HLO (jaxserve.step_cost; one layer's pool and the stacked pool). Then decode
steps (16 rows, 256 tokens of context) of unrolled and scanned, alternating rounds in one
process: the median step time ratio scanned/unrolled.

  python benchmarks/scan_layers.py [--rounds 6]
"""
import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find jaxserve/
from jaxserve.attention import AttentionMetadata  # noqa: E402
from jaxserve.buckets import StepShape  # noqa: E402
from jaxserve.checkpoint import load_params  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.engine import TINY_MODEL_DIR  # noqa: E402
from jaxserve.kv_cache import LayerKV  # noqa: E402
from jaxserve.models.layers import RMSNorm  # noqa: E402
from jaxserve.models.llama import DecoderLayer  # noqa: E402
from jaxserve.runner import ModelRunner  # noqa: E402
from jaxserve.step import lower_step  # noqa: E402
from jaxserve.step_cost import step_cost  # noqa: E402


def scanned_step(runner: ModelRunner, kv_in: str):
    """runner's step with the layers scanned; call as (stacked_params, (k, v), *arrays, **static)."""
    cfg = runner.cfg
    layer = DecoderLayer(cfg, 0, runner.dtype)   # the tiny model has no sliding window: one run
    norm = RMSNorm(cfg.rms_norm_eps, runner.dtype)

    @functools.partial(jax.jit, static_argnames=("num_prefill_rows", "max_q"), donate_argnames=("kv",))
    def step(params, kv, tokens, positions, slot_mapping, page_table, seq_lens, query_start_loc,
             logits_index, *, num_prefill_rows, max_q):
        meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_table=page_table,
                                 seq_lens=seq_lens, query_start_loc=query_start_loc, max_q=max_q,
                                 num_prefill_rows=num_prefill_rows, backend="xla", platform="cpu")
        x = params["model"]["embed_tokens"]["embedding"][tokens]
        if kv_in == "xs":
            def body(x, xs):
                p, k, v = xs
                x, layer_kv = layer.apply({"params": p}, x, positions, LayerKV(k, v), meta)
                return x, (layer_kv.k, layer_kv.v)
            x, kv = jax.lax.scan(body, x, (params["layers"], *kv))
        else:
            def body(carry, xs):
                x, k_all, v_all = carry
                p, i = xs
                x, layer_kv = layer.apply({"params": p}, x, positions, LayerKV(k_all[i], v_all[i]), meta)
                return (x, k_all.at[i].set(layer_kv.k), v_all.at[i].set(layer_kv.v)), None
            (x, *kv), _ = jax.lax.scan(body, (x, *kv), (params["layers"], jnp.arange(cfg.num_layers)))
        hidden = norm.apply({"params": params["model"]["norm"]}, x[logits_index])
        logits = runner.model.apply({"params": runner.params}, hidden, method=runner.model.logits)
        return logits, tuple(kv)

    return step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    ecfg = EngineConfig(max_model_len=512, page_size=16, kv_cache_mb=64, max_num_seqs=16, max_num_batched_tokens=128,
                        prefill_chunk_size=128, max_prefill_seqs=2, compilation_cache_dir=None)
    runner = ModelRunner(cfg, load_params(TINY_MODEL_DIR, cfg), ecfg)
    layers = [runner.params["model"][f"layers_{i}"] for i in range(cfg.num_layers)]
    stacked = {"model": runner.params["model"], "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
    pool = runner.kv_cache.layers[0].k
    mp, padding_slot = runner.max_pages_per_seq, runner.num_pages * runner.page_size
    steps = {kv_in: scanned_step(runner, kv_in) for kv_in in ("xs", "carry")}
    stacked_kv = {kv_in: tuple(jnp.zeros((cfg.num_layers, *pool.shape), pool.dtype) for _ in "kv") for kv_in in steps}

    for shape in (StepShape(16, 16, 0, 1), StepShape(128, 16, 2, 128)):
        static = dict(num_prefill_rows=shape.prefill_rows, max_q=shape.max_q)
        lowerings = {"unrolled": lambda: lower_step(runner._step, runner.params, runner.kv_cache, shape, mp,
                                                    padding_slot, runner._last_sampled)}
        for kv_in, step in steps.items():
            lowerings[f"scan/{kv_in}"] = functools.partial(step.lower, stacked, stacked_kv[kv_in],
                                                           *shape.empty_batch(mp, padding_slot), **static)
        for name, lower in lowerings.items():
            t0 = time.perf_counter()
            lowered = lower()
            t1 = time.perf_counter()
            hlo = lowered.compile().as_text()
            t2 = time.perf_counter()
            copies = [step_cost(hlo, n * pool.nbytes).whole_pool_copies for n in (1, cfg.num_layers)]
            print(f"{shape.name:20s} {name:10s} lower {t1 - t0:5.2f}s  compile {t2 - t1:5.2f}s  "
                  f"copies of a layer's pool {copies[0]}, of the stacked pool {copies[1]}", flush=True)

    # decode: 16 rows, each at 256 tokens of context (its last page holds the new token)
    ctx, rows = 256, 16
    page_table = (np.arange(rows * mp, dtype=np.int32).reshape(rows, mp) % runner.num_pages)
    rng = np.random.default_rng(0)
    arrays = (rng.integers(0, cfg.vocab_size, rows).astype(np.int32), np.full(rows, ctx - 1, np.int32),
              page_table[:, ctx // runner.page_size - 1] * runner.page_size + runner.page_size - 1, page_table,
              np.full(rows, ctx, np.int32), np.arange(rows + 1, dtype=np.int32), np.arange(rows, dtype=np.int32))
    static = dict(num_prefill_rows=0, max_q=1)
    caches = {"unrolled": runner.kv_cache, **stacked_kv}

    def run(name: str, n: int):
        for _ in range(n):
            if name == "unrolled":
                logits, caches[name], _ = runner._step(runner.params, caches[name], *arrays,
                                                       np.full(rows, -1, np.int32), runner._last_sampled, **static)
            else:
                logits, caches[name] = steps[name](stacked, caches[name], *arrays, **static)
        return jax.block_until_ready(logits)

    first = {name: run(name, 2) for name in caches}
    for kv_in in steps:
        print(f"max |logits unrolled - scan/{kv_in}|: {float(jnp.max(jnp.abs(first['unrolled'] - first[kv_in]))):.2e}")
    times = {name: [] for name in caches}
    for _ in range(args.rounds):
        for name in caches:
            t0 = time.perf_counter()
            run(name, 10)
            times[name].append((time.perf_counter() - t0) / 10)
    base = np.median(times["unrolled"])
    for name, ts in times.items():
        print(f"decode-{rows} step, context {ctx}: {name:10s} median {np.median(ts) * 1e3:7.2f} ms  "
              f"ratio to unrolled {np.median(ts) / base:.2f}")


if __name__ == "__main__":
    main()
