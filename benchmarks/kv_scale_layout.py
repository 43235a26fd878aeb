"""What XLA:TPU does with a quantized KV cache's scale pools around the Pallas paged kernel.

Compiles one layer's decode step of the attention (`attention.attend`: the int8 write of 64 new
tokens, then the paged kernel reading 4096 pages; the cache donated, as in the engine) for
compile-only v5e and v6e chips (libtpu) and reads the compiled HLO: the layout XLA gives a scale
pool at rest (the entry parameter), the instructions that copy a whole scale pool or a whole
page pool (jaxserve/step_cost.py), and memory_analysis()'s argument and temporary bytes. The
scale pools' shape is whatever jaxserve/kv_cache.py's KVCache.spec says, so the same command
run against another checkout measures that checkout's layout:

  python -m benchmarks.kv_scale_layout                            # this tree
  cd ../main && python /path/to/this/benchmarks/kv_scale_layout.py   # the jaxserve installed there
"""
import itertools
import math
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from jaxserve import attention, parallel, step_cost
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache

NUM_PAGES, HEAD_DIM, GROUP, SEQS = 4096, 128, 4, 64
CASES = [(2, 32), (8, 32), (1, 64), (8, 128)]   # (KV heads, page size); int8 pools need 32-row pages
GENERATIONS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2"}
MiB = 2 ** 20


def compile_decode(device, kv_heads: int, page_size: int, write: bool):
    mesh = parallel.make_mesh(None, [device])
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=kv_heads * GROUP * HEAD_DIM,
                      intermediate_size=256, num_layers=1, num_heads=kv_heads * GROUP, num_kv_heads=kv_heads,
                      head_dim=HEAD_DIM, max_position_embeddings=8192)
    kv = KVCache.spec(cfg, mesh, NUM_PAGES, page_size, jnp.bfloat16, "int8").layers[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def on(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def decode(q, k, v, kv, slots, table, lens, qsl):
        meta = attention.AttentionMetadata(positions=None, slot_mapping=slots, page_table=table, seq_lens=lens,
                                           query_start_loc=qsl, max_q=1, num_prefill_rows=0, backend="pallas_tpu",
                                           platform="tpu")
        if write:
            return attention.attend(q, k, v, kv, meta, sliding_window=None, sm_scale=HEAD_DIM ** -0.5)
        return attention.paged_attention(q, kv, meta, sliding_window=None, sm_scale=HEAD_DIM ** -0.5)

    new = on((SEQS, kv_heads, HEAD_DIM), jnp.bfloat16)
    args = (on((SEQS, kv_heads * GROUP, HEAD_DIM), jnp.bfloat16), new, new, kv, on((SEQS,), jnp.int32),
            on((SEQS, NUM_PAGES // SEQS), jnp.int32), on((SEQS,), jnp.int32), on((SEQS + 1,), jnp.int32))
    return jax.jit(decode, donate_argnums=3).lower(*args).compile(), kv


def describe(compiled, kv) -> dict:
    hlo = compiled.as_text()
    scale, pool = kv.k_scale, kv.k
    dims = ",".join(map(str, scale.shape))
    at_rest = re.search(rf"(f32\[{dims}\]\{{[^}}]*\}}) parameter\(", hlo).group(1)

    def copies(x):
        cost = step_cost.step_cost(hlo, math.prod(x.shape) * x.dtype.itemsize)
        results = [re.search(rf"%{re.escape(c.split()[1])} = (\S+)", hlo).group(1) for c in cost.copies]
        return f"{cost.whole_pool_copies} " + " ".join(results)

    memory = compiled.memory_analysis()
    return {"scale pool": f"{scale.shape}", "at rest": at_rest, "scale-pool copies": copies(scale),
            "page-pool copies": copies(pool), "arguments MiB": f"{memory.argument_size_in_bytes / MiB:.2f}",
            "logical MiB": f"{sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(kv)) / MiB:.2f}",
            "temporaries MiB": f"{memory.temp_size_in_bytes / MiB:.2f}"}


def main():
    rows = []
    for generation, topology in GENERATIONS.items():
        device = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[0]
        for (kv_heads, page_size), write in itertools.product(CASES, (False, True)):
            compiled, kv = compile_decode(device, kv_heads, page_size, write)
            rows.append({"chip": generation, "KV heads": kv_heads, "page size": page_size,
                         "step": "write + read" if write else "read", **describe(compiled, kv)})
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
