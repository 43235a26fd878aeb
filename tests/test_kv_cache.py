"""KVCache against numpy: the write of new K/V into slots (quantized too), whole-page copies and
fills, and its size in bytes against the sizing arithmetic the runner and `jaxserve check` use;
a cache without V pools (latent attention) through every attention path;
int8 / fp8 caches through the engine: held-out perplexity and pages at the same memory."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kv_quantization as kv_bench, quantization as quantization_bench
from jaxserve import LLM, attention, cli, kv_cache, parallel
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import KVCache, LayerKV, page_bytes_per_chip
from jaxserve.quantization import quantize_rows
from tests.test_paged_attention import CACHED, FRESH, assert_close, attend_case

CFG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=8, max_position_embeddings=64)
NUM_PAGES, PAGE_SIZE = 6, 4


def random_cache(seed: int) -> KVCache:
    rng = np.random.default_rng(seed)
    cache = KVCache.zeros(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.float32)
    return KVCache(tuple(LayerKV(*(jnp.asarray(rng.standard_normal(kv.k.shape), jnp.float32) for _ in "kv"))
                         for kv in cache.layers))


def as_numpy(cache: KVCache) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(np.array(kv.k), np.array(kv.v)) for kv in cache.layers]


def test_zeros_has_the_layout_and_the_bytes_sizing_counts():
    cache = KVCache.zeros(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.float32)
    assert len(cache.layers) == CFG.num_layers
    assert cache.layers[0].k.shape == (NUM_PAGES, CFG.num_kv_heads, PAGE_SIZE, CFG.head_dim)
    assert (cache.num_pages, cache.page_size) == (NUM_PAGES, PAGE_SIZE)
    assert cache.nbytes == NUM_PAGES * page_bytes_per_chip(CFG, jnp.float32, PAGE_SIZE, 1, tpu=False)
    assert cache.nbytes == 2 * CFG.num_layers * NUM_PAGES * CFG.num_kv_heads * PAGE_SIZE * CFG.head_dim * 4
    assert not any(np.asarray(x).any() for kv in cache.layers for x in (kv.k, kv.v))


def test_write_puts_each_token_at_its_slot_and_drops_padding():
    layer = random_cache(0).layers[0]
    before_k, before_v = np.array(layer.k), np.array(layer.v)
    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((5, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32) for _ in "kv")
    slots = np.array([0, 7, 13, 23, NUM_PAGES * PAGE_SIZE], np.int32)   # the last is padding
    written, given_back = layer.write(jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for want, got, new, back in ((before_k, written.k, k, given_back[0]), (before_v, written.v, v, given_back[1])):
        for t, slot in enumerate(slots[:-1]):
            want[slot // PAGE_SIZE, :, slot % PAGE_SIZE] = new[t]
        np.testing.assert_array_equal(np.asarray(got), want)
        np.testing.assert_array_equal(np.asarray(back), new)   # a float32 pool holds them as they are


def test_copy_and_fill_pages_touch_only_the_listed_pages_in_every_layer():
    cache = random_cache(2)
    want = as_numpy(cache)
    src, dst = np.array([1, 4, 0], np.int32), np.array([3, 5, NUM_PAGES], np.int32)   # dst NUM_PAGES: no-op
    cache = cache.copy_pages(jnp.asarray(src), jnp.asarray(dst))
    for k, v in want:
        k[[3, 5]], v[[3, 5]] = k[[1, 4]], v[[1, 4]]
    for (wk, wv), kv in zip(want, cache.layers):
        np.testing.assert_array_equal(np.asarray(kv.k), wk)
        np.testing.assert_array_equal(np.asarray(kv.v), wv)
    cache = cache.fill_pages(jnp.asarray([2, NUM_PAGES], jnp.int32), np.float32("nan"))
    for (wk, wv), kv in zip(want, cache.layers):
        wk[2], wv[2] = np.nan, np.nan
        np.testing.assert_array_equal(np.asarray(kv.k), wk)
        np.testing.assert_array_equal(np.asarray(kv.v), wv)


def test_abstract_keeps_shapes_dtypes_and_shardings():
    cache = KVCache.zeros(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
    spec = KVCache.spec(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.bfloat16)
    for a, s in zip(cache.abstract().layers, spec.layers):
        assert (a.k.shape, a.k.dtype, a.k.sharding) == (s.k.shape, s.k.dtype, s.k.sharding)


def test_quantized_write_stores_each_head_vector_with_its_scale():
    cache = KVCache.zeros(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.float32, "int8")
    layer = cache.layers[0]
    assert layer.k.dtype == jnp.int8 and layer.k_scale.shape == (NUM_PAGES, CFG.num_kv_heads, 1, PAGE_SIZE)
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((3, CFG.num_kv_heads, CFG.head_dim)).astype(np.float32) for _ in "kv")
    k[1, 0] = 0   # an all-zero head vector: scale 1, stored zeros
    slots = np.array([2, 9, 22], np.int32)
    written, given_back = layer.write(jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for new, stored, scales, back in ((k, written.k, written.k_scale, given_back[0]),
                                      (v, written.v, written.v_scale, given_back[1])):
        for t, slot in enumerate(slots):
            page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
            amax = np.abs(new[t]).max(axis=-1)
            want_scale = np.where(amax > 0, amax / 127, 1).astype(np.float32)
            np.testing.assert_allclose(np.asarray(scales[page, :, 0, offset]), want_scale, rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(stored[page, :, offset]),
                                          np.round(new[t] / want_scale[:, None]).astype(np.int8))
            # what write gives back is what the pools hold, bit for bit: stored * scale
            np.testing.assert_array_equal(np.asarray(back[t]), np.asarray(stored[page, :, offset], np.float32)
                                          * np.asarray(scales[page, :, 0, offset])[:, None])
    assert cache.nbytes == NUM_PAGES * page_bytes_per_chip(CFG, jnp.float32, PAGE_SIZE, 1, tpu=False,
                                                          kv_cache_dtype="int8")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_tpu_writes_one_byte_pools_in_whole_pages_with_the_same_result(kv_cache_dtype, monkeypatch):
    """XLA:TPU copies a whole int8 / fp8 pool to write single slot rows, so on TPU LayerKV.write
    writes whole pages (kv_cache._put_whole_pages). Against numpy's row by row assignment, as
    the row write: tokens out of order, several in one page, pages written in part, padding."""
    layer = KVCache.zeros(CFG, parallel.make_mesh({}), NUM_PAGES, PAGE_SIZE, jnp.float32, kv_cache_dtype).layers[0]
    rng = np.random.default_rng(4)
    before = [rng.integers(-100, 100, layer.k.shape).astype(np.int8).astype(layer.k.dtype) for _ in "kv"]
    layer = LayerKV(*(jnp.asarray(x) for x in before), layer.k_scale, layer.v_scale)
    padding = NUM_PAGES * PAGE_SIZE
    slots = jnp.asarray([5, 6, padding, 23, 7, 0, 4, 22, padding], jnp.int32)
    new = [jnp.asarray(rng.standard_normal((len(slots), CFG.num_kv_heads, CFG.head_dim)), jnp.float32) for _ in "kv"]
    calls = []
    whole_pages = kv_cache._put_whole_pages
    monkeypatch.setattr(kv_cache, "_put_whole_pages", lambda *a: calls.append(1) or whole_pages(*a))
    by_pages, _ = layer.write(*new, slots, "tpu")
    by_rows, _ = layer.write(*new, slots, "cpu")
    assert len(calls) == 2   # K and V, on TPU only
    for pool, x, got_pages, got_rows in zip(before, new, (by_pages.k, by_pages.v), (by_rows.k, by_rows.v)):
        stored = np.asarray(quantize_rows(x, pool.dtype)[0])
        want = pool.copy()
        for t, slot in enumerate(np.asarray(slots)):
            if slot != padding:
                want[slot // PAGE_SIZE, :, slot % PAGE_SIZE] = stored[t]
        for got in (got_pages, got_rows):   # compared as bytes: fp8 has no exact numpy equality for NaN
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(by_pages.k_scale, by_rows.k_scale)
    np.testing.assert_array_equal(by_pages.v_scale, by_rows.v_scale)


def test_tpu_page_bytes_count_the_scales_whole_lanes():
    """On TPU a page's scales of one KV head take whole 128 lanes (kv_cache.scale_lanes), and the
    int8 pool's head_dim 8 takes 128 lanes and page slots whole 32-row int8 tiles."""
    per_head = {32: 32 * 128 + 128 * 4, 256: 256 * 128 + 256 * 4, 16: 32 * 128 + 128 * 4}
    for page_size, head_bytes in per_head.items():
        assert page_bytes_per_chip(CFG, jnp.float32, page_size, 1, tpu=True, kv_cache_dtype="int8") == \
            2 * CFG.num_layers * CFG.num_kv_heads * head_bytes, page_size
    assert [kv_cache.scale_lanes(n, "tpu") for n in (16, 128, 160)] == [128, 128, 256]
    assert [kv_cache.scale_lanes(n, p) for n in (16, 160) for p in ("cpu", "gpu")] == [16, 16, 160, 160]


def test_kv_cache_dtype_is_checked_and_reaches_the_engine_config():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig(kv_cache_dtype="int4")
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--kv-cache-dtype", "fp8"])
    assert cli.engine_config(args).kv_cache_dtype == "fp8"


def test_flash_path_quantizes_the_new_kv_once(monkeypatch):
    """A Pallas step with a fresh prefill row (flash fed this step's K/V) quantizes K and V once
    each, in LayerKV.write, and the flash kernel takes what write gives back."""
    calls = []
    quantize_rows = kv_cache.quantize_rows
    monkeypatch.setattr(kv_cache, "quantize_rows", lambda x, dtype: calls.append(dtype) or quantize_rows(x, dtype))
    t, kvh, ps, d = 8, 2, 16, 64
    pool, scales = jnp.zeros((4, kvh, ps, d), jnp.int8), jnp.ones((4, kvh, 1, ps), jnp.float32)
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=jnp.arange(t), page_table=jnp.zeros((2, 1), jnp.int32),
        seq_lens=jnp.array([t, 0]), query_start_loc=jnp.array([0, t, t]), max_q=t, num_prefill_rows=1,
        backend="pallas_tpu")
    jax.make_jaxpr(lambda q, k, v, kv: attention.attend(q, k, v, kv, meta, sliding_window=None, sm_scale=0.1))(
        jnp.ones((t, 2 * kvh, d)), jnp.ones((t, kvh, d)), jnp.ones((t, kvh, d)), LayerKV(pool, pool, scales, scales))
    assert len(calls) == 2


def test_quantized_cache_holds_more_pages_and_keeps_perplexity_within_one_percent():
    """The embedded model's held-out perplexity on 8 windows through an int8-cache engine's
    prefill (prompt logprobs read back from the pages) against the float32 forward pass without a
    cache, and the pool at the same kv_cache_mb (fp8's arithmetic: test_paged_attention.py)."""
    reference = quantization_bench.heldout_perplexities(configs=(None,), max_windows=8)[None]
    # 128-token chunks (9 step shapes to warm up, not the default 45): each window's later chunks read the int8 pages
    llm = LLM(kv_cache_dtype="int8", max_num_seqs=4, max_num_batched_tokens=128, prefill_chunk_size=128,
              max_prefill_seqs=1, max_model_len=256, kv_cache_mb=4, compilation_cache_dir=None)
    ppl = kv_bench.engine_perplexity(llm, kv_bench.heldout_windows(8))
    assert abs(ppl / reference - 1) < 0.01, (ppl, reference)
    # float32 head_dim 32: 128 bytes per head and slot against 32 + a 4-byte scale
    cfg, pages = llm.llm_engine.model_cfg, llm.llm_engine.runner.num_pages
    assert pages == 4 * 2**20 // page_bytes_per_chip(cfg, jnp.float32, 16, 1, False, "int8")
    assert pages >= 3.5 * (4 * 2**20 // page_bytes_per_chip(cfg, jnp.float32, 16, 1, False))


def test_pool_head_dim_pads_only_on_tpu():
    assert [kv_cache.pool_head_dim(d, "tpu") for d in (32, 64, 96, 128, 256)] == [128, 128, 128, 128, 256]
    assert [kv_cache.pool_head_dim(d, p) for d in (32, 96) for p in ("cpu", "gpu")] == [32, 32, 96, 96]


# Not pallas_gpu int8 (50 s in interpret mode): its dequantize in place, checked on its own in
# tests/test_gpu_kernels.py, serves a V pool the same way.
@pytest.mark.parametrize("backend, kv_dtype", [(b, kv) for b in ("xla", "pallas_tpu") for kv in ("auto", "int8")]
                         + [("pallas_gpu", "auto")])
def test_values_are_read_from_the_key_pages(backend, kv_dtype):
    """Without a V pool (latent attention) a step writes K alone and every path (flash for the
    fresh rows, the paged kernels for the cached and decode rows) reads the values from the K
    pages (quantized: through K's scales), against the oracle given the K pages as V."""
    for seqs in (FRESH, CACHED):
        out, case = attend_case(seqs, backend, kv_dtype=kv_dtype, values_are_keys=True)
        assert_close(out, case)
