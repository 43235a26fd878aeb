"""Latent attention's KV cache held once (values read from the K pages) against a K and a V pool
holding the same latent, side by side in one process.

The attention of a DeepSeek-V3 decode step on one chip of a TP 8 mesh: 16 query heads over the
one 576-dim latent KV head, each sequence `--context` tokens long, in pages of 32. Two layouts of
the same values: "K pool alone" (LayerKV.v None, as the engine now holds it) and "K and V pools"
(the layout before: the latent stored twice). Per layout: the pool bytes, and the time of the XLA
path's call (the engine's attention on CPU), alternating layouts each round; outputs must agree.

  python -m benchmarks.latent_kv --out benchmarks/results/latent_kv_cpu.md
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import markdown_table, publish
from pallas_kernels.paged_attention import xla

HEADS, HEAD_DIM, PAGE = 16, 576, 32   # V3's 128 heads over 8 chips; kv_lora_rank 512 + rope 64
MiB = 2 ** 20


def case(batch: int, context: int, dtype):
    rng = np.random.default_rng(0)
    pages_per_seq = context // PAGE
    num_pages = batch * pages_per_seq
    k = jnp.asarray(rng.standard_normal((num_pages, 1, PAGE, HEAD_DIM)), dtype)
    table = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages_per_seq).astype(np.int32))
    q = jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM)), dtype)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k, table, lens, jnp.arange(batch + 1, dtype=jnp.int32)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    q, k, table, lens, qsl = case(args.batch, args.context, jnp.bfloat16)
    v = k + 0   # the same latent, in its own buffer: the V pool of the layout before
    call = jax.jit(lambda q, k, v, t, s, l: xla.ragged_paged_attention(q, k, v, t, s, l, max_q=1, sm_scale=0.05))
    layouts = {"K pool alone": (k, None), "K and V pools": (k, v)}
    outs = {name: call(q, *pools, table, lens, qsl).block_until_ready() for name, pools in layouts.items()}
    diff = float(jnp.abs(outs["K pool alone"].astype(jnp.float32) - outs["K and V pools"].astype(jnp.float32)).max())
    times = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for name, pools in layouts.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                call(q, *pools, table, lens, qsl).block_until_ready()
            times[name].append((time.perf_counter() - start) / args.calls)
    base = np.median(times["K and V pools"])
    rows = [[name, f"{sum(x.nbytes for x in pools if x is not None) / MiB:.0f}",
             f"{np.median(times[name]) * 1e3:.1f}", f"{min(times[name]) * 1e3:.1f}",
             f"{base / np.median(times[name]):.2f}x"] for name, pools in layouts.items()]
    publish("Latent KV cache: K alone against K and V pools (XLA path)", "latent_kv", argv, args.out,
            f"One layer's decode attention: {args.batch} sequences x {args.context} tokens, {HEADS} query heads "
            f"over one {HEAD_DIM}-dim latent KV head (DeepSeek-V3 at TP 8), bf16 pages of {PAGE}. Median and best "
            f"of {args.rounds} alternating rounds of {args.calls} calls. Largest output difference between the "
            f"layouts: {diff:.1e}.", "",
            *markdown_table(["layout", "pool MiB", "median ms", "best ms", "speed vs K and V"], rows, (1, 2, 3, 4)))


if __name__ == "__main__":
    main()
