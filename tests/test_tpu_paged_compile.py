"""The TPU paged kernel through the engine's attention dispatch and the real Mosaic compiler of
each TPU generation (libtpu, compile-only TPU devices on this CPU host): interpret mode checks the
arithmetic, not what a chip accepts. Arrays on TPU devices reach Mosaic (with soft cap, ALiBi and
sinks); int8 pools with their scales (and a latent cache's K pool alone) compile on every
generation without whole-pool copies; under TP each chip's kernels get its own heads' slopes and
sinks. The kernel's own shapes on every generation: test_tpu_compile's covering grid."""
import math
import os

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve import attention, kv_cache, parallel, step_cost
from jaxserve.kv_cache import LayerKV

# Compile-only use: other processes holding libtpu (parallel test workers) do not conflict.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
from jax.experimental import topologies  # noqa: E402

from pallas_kernels.flash_attention import tpu as flash_tpu  # noqa: E402
from pallas_kernels.paged_attention import tpu  # noqa: E402

GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MIXED = (256, 32, 64, 2048)   # a mixed batch: tokens, sequences, max_q, longest sequence


@pytest.fixture(scope="module", params=list(GENERATIONS))
def tpu_device(request):
    return topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS[request.param]).devices[0]


def on_device(device, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.SingleDeviceSharding(device))


def abstract_case(device, head_dim, kv_heads, group, page_size, dtype, pool_dtype=None):
    """ShapeDtypeStructs on `device` for (q, k_pages, v_pages, page_table, seq_lens, qsl) of the
    MIXED batch; the pools in pool_dtype (default: dtype)."""
    tokens, seqs, _, max_len = MIXED
    pages_per_seq = max_len // page_size
    pool = on_device(device, (seqs * pages_per_seq, kv_heads, page_size, head_dim), pool_dtype or dtype)
    return (on_device(device, (tokens, kv_heads * group, head_dim), dtype), pool, pool,
            on_device(device, (seqs, pages_per_seq), jnp.int32), on_device(device, (seqs,), jnp.int32),
            on_device(device, (seqs + 1,), jnp.int32))


def test_dispatch_reaches_mosaic_for_tpu_arrays():
    # On a CPU host, arrays on TPU devices must take the real kernel, not the interpreter; with
    # soft cap, ALiBi slopes and sinks (extra kernel inputs) too.
    device = topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS["v5e"]).devices[0]
    q, k_pages, v_pages, table, lens, qsl = abstract_case(device, 128, 2, 4, 16, "bfloat16")
    slopes = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))

    def step(q, k_pages, v_pages, table, lens, qsl, slopes, sinks):
        meta = attention.AttentionMetadata(
            positions=None, slot_mapping=None, page_table=table, seq_lens=lens, query_start_loc=qsl,
            max_q=MIXED[2], backend="pallas_tpu",
            platform=parallel.platform(parallel.make_mesh(None, [device])))
        return attention.paged_attention(q, LayerKV(k_pages, v_pages), meta, sliding_window=None, sm_scale=0.1,
                                         soft_cap=30.0, alibi_slopes=slopes, sinks=sinks)

    lowered = jax.jit(step).lower(q, k_pages, v_pages, table, lens, qsl, slopes, slopes)
    assert "tpu_custom_call" in lowered.as_text()
    lowered.compile()


@pytest.mark.parametrize("kv_dtype, values_are_keys", [("int8", False), ("int8", True)],
                         ids=["int8", "int8-values_are_keys"])
def test_paged_kernel_reads_quantized_pools_on_tpu(tpu_device, kv_dtype, values_are_keys):
    # int8 pools with their f32 scales [N, KVH, 1, 128] (jaxserve/kv_cache.py), bf16 q, GQA,
    # the mixed batch, through the engine's dispatch: the scale DMAs and the kernel's int8 reads.
    # XLA does not copy a whole scale pool before the call (it did, 4x padded, when scales were
    # [N, KVH, page_size]: benchmarks/results/kv_quantization.md), nor a page pool. values_are_keys:
    # a latent cache's K pool alone, as DeepSeek-V3 at TP 8 has it (16 query heads over one KV head
    # of 576 dims, stored in 640 lanes).
    head_dim, kv_heads, group = (640, 1, 16) if values_are_keys else (128, 2, 4)
    q, k_pages, v_pages, table, lens, qsl = abstract_case(tpu_device, head_dim, kv_heads, group, 32, "bfloat16",
                                                          pool_dtype=kv_cache.KV_CACHE_DTYPES[kv_dtype])
    scales = on_device(tpu_device, (k_pages.shape[0], kv_heads, 1, kv_cache.scale_lanes(32, "tpu")), jnp.float32)

    def step(q, kv, table, lens, qsl):
        meta = attention.AttentionMetadata(
            positions=None, slot_mapping=None, page_table=table, seq_lens=lens, query_start_loc=qsl,
            max_q=MIXED[2], backend="pallas_tpu",
            platform=parallel.platform(parallel.make_mesh(None, [tpu_device])))
        return attention.paged_attention(q, kv, meta, sliding_window=100, sm_scale=0.1)

    pools = LayerKV(k_pages, None, scales) if values_are_keys else LayerKV(k_pages, v_pages, scales, scales)
    lowered = jax.jit(step).lower(q, pools, table, lens, qsl)
    assert "tpu_custom_call" in lowered.as_text()
    hlo = lowered.compile().as_text()
    for pool in (scales, k_pages):
        cost = step_cost.step_cost(hlo, math.prod(pool.shape) * pool.dtype.itemsize)
        # One KV head's scale pool (1 MiB here) is small enough for XLA to prefetch it whole into
        # VMEM (a copy-start into memory space S(1)), as it does with a V pool beside it: no
        # layout copy, which is what this test is after.
        prefetched = values_are_keys and pool is scales and all(c.startswith("copy-start") for c in cost.copies)
        assert cost.whole_pool_copies == 0 or prefetched, (pool.shape, cost.copies)


def test_per_head_arguments_split_with_query_heads_under_tp(monkeypatch):
    """Tensor parallelism over 4 v5e chips, KV heads split: each chip's paged and flash kernels
    get its own query heads' ALiBi slopes and sinks (4 of 16) through paged_attention's
    shard_map, and the step compiles."""
    seen = set()   # (kernel, slopes shape, sinks shape) as traced

    def recording(name, kernel):
        def call(*args, alibi_slopes=None, sinks=None, **kwargs):
            seen.add((name, alibi_slopes.shape, sinks.shape))
            return kernel(*args, alibi_slopes=alibi_slopes, sinks=sinks, **kwargs)
        return call
    monkeypatch.setattr(tpu, "ragged_paged_attention", recording("paged", tpu.ragged_paged_attention))
    monkeypatch.setattr(flash_tpu, "flash_attention", recording("flash", flash_tpu.flash_attention))
    devices = topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS["v5e"]).devices
    mesh = parallel.make_mesh({"model": 4}, devices)
    tokens, seqs, max_q, max_len = MIXED
    pages_per_seq = max_len // 16

    def on_mesh(shape, dtype, *spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
    heads = on_mesh((tokens, 16, 128), jnp.bfloat16, None, "model")
    new_kv = on_mesh((tokens, 8, 128), jnp.bfloat16, None, "model")
    pool = on_mesh((seqs * pages_per_seq, 8, 16, 128), jnp.bfloat16, None, "model")
    tables = (on_mesh((seqs, pages_per_seq), jnp.int32), on_mesh((seqs,), jnp.int32), on_mesh((seqs + 1,), jnp.int32))
    per_head = on_mesh((16,), jnp.float32)

    def step(q, k, v, k_pages, v_pages, table, lens, qsl, slopes, sinks):
        meta = attention.AttentionMetadata(
            positions=None, slot_mapping=None, page_table=table, seq_lens=lens, query_start_loc=qsl, max_q=max_q,
            num_prefill_rows=2, backend="pallas_tpu", platform="tpu", kv_sharding=pool.sharding)
        return attention.paged_attention(q, LayerKV(k_pages, v_pages), meta, sliding_window=128, sm_scale=0.1,
                                         alibi_slopes=slopes, sinks=sinks, k=k, v=v)

    lowered = jax.jit(step).lower(heads, new_kv, new_kv, pool, pool, *tables, per_head, per_head)
    assert seen == {("paged", (4,), (4,)), ("flash", (4,), (4,))}, seen
    lowered.compile()
