"""The GPU kernels, in interpret mode on CPU and compiled for real on a GPU: the paged kernel over
pools in the [num_pages, num_kv_heads, page_size, head_dim] layout against a float64 numpy oracle;
the flash kernel over 3 and more KV blocks (double-buffer slots reused, barrier phases flipped),
interpreted under Mosaic GPU's race detector; the flash shared-memory budget against Mosaic GPU's."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from pallas_kernels.flash_attention import gpu as flash_gpu
from pallas_kernels.flash_attention.reference import causal_attention
from pallas_kernels.paged_attention import gpu as paged_gpu
from jaxserve.attention import resolve_backend
from jaxserve.kv_cache import KV_CACHE_DTYPES
from tests.test_flash_attention import GPU_INTERPRET as INTERPRET
from tests.test_paged_attention import TOL, cases, mixed_batch, poison_unread, quantized


def paged_case(seed, *, seqs, num_kv_heads, group, head_dim, page_size, dtype, pad_tokens=0,
               lead_tokens=0, sliding_window=None):
    """seqs: (q_len, kv_len) per batch slot. Each sequence's pages are scattered through a pool
    with spare random pages; unused page-table entries point at random pages. lead_tokens come
    before query_start_loc[0], pad_tokens after its end: both belong to no sequence (output 0)."""
    rng = np.random.default_rng(seed)
    counts = [math.ceil(kv / page_size) for _, kv in seqs]
    num_pages = sum(counts) + 3
    table = rng.integers(0, num_pages, (len(seqs), max(1, *counts))).astype(np.int32)
    perm, used = rng.permutation(num_pages), 0
    for s, n in enumerate(counts):
        table[s, :n] = perm[used:used + n]
        used += n
    q_lens = np.array([ql for ql, _ in seqs], np.int32)
    t = lead_tokens + int(q_lens.sum()) + max(pad_tokens, 1)
    pool = (num_pages, num_kv_heads, page_size, head_dim)
    return dict(
        q=rng.standard_normal((t, num_kv_heads * group, head_dim)).astype(dtype),
        k_pages=rng.standard_normal(pool).astype(dtype), v_pages=rng.standard_normal(pool).astype(dtype),
        page_table=table, seq_lens=np.array([kv for _, kv in seqs], np.int32),
        query_start_loc=(lead_tokens + np.concatenate([[0], np.cumsum(q_lens)])).astype(np.int32),
        max_q=max(1, int(q_lens.max())), sm_scale=head_dim ** -0.5, sliding_window=sliding_window)


def paged_oracle(c):
    """float64, one sequence at a time; token t of sequence s sits at kv_len - q_len + (t - start).
    c["sinks"] (f32[H], optional): each head's sink logit, one more softmax column, dropped."""
    q, k_pages, v_pages = (np.asarray(c[x], np.float64) for x in ("q", "k_pages", "v_pages"))
    page_size, group = k_pages.shape[2], q.shape[1] // k_pages.shape[1]
    out = np.zeros_like(q)
    for s, kv_len in enumerate(c["seq_lens"]):
        start, end = c["query_start_loc"][s], c["query_start_loc"][s + 1]
        if start == end:
            continue
        kv_pos = np.arange(kv_len)
        page, offset = c["page_table"][s][kv_pos // page_size], kv_pos % page_size
        k = np.repeat(k_pages[page, :, offset], group, axis=1)  # [kv_len, H, D]
        v = np.repeat(v_pages[page, :, offset], group, axis=1)
        q_pos = kv_len - (end - start) + np.arange(end - start)
        seen = kv_pos[None, :] <= q_pos[:, None]
        if c["sliding_window"] is not None:
            seen &= kv_pos[None, :] > q_pos[:, None] - c["sliding_window"]
        scores = np.einsum("thd,jhd->thj", q[start:end], k) * c["sm_scale"]
        scores = np.where(seen[:, None, :], scores, -np.inf)
        if c.get("sinks") is not None:
            sinks = np.broadcast_to(np.asarray(c["sinks"], np.float64)[:, None], (end - start, len(c["sinks"]), 1))
            scores = np.concatenate([scores, sinks], axis=-1)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[start:end] = np.einsum("thj,jhd->thd", (w / w.sum(-1, keepdims=True))[..., :kv_len], v)
    return out


# Compiled on a GPU, the paged kernel also runs under its other lowering semantics (wgmma.compiler_params),
# timed by `benchmarks/kernels.py --lane`; on_gpu.sh's lane stage runs both apart. The interpreter
# lowers neither.
LOWERINGS = ("warpgroup",) if INTERPRET else ("warpgroup", "lane")


@pytest.fixture(params=LOWERINGS)
def lowering(request):
    return request.param


def run_paged(c, **blocks):
    """The kernel on case c against the oracle; quantized pools when c has k_scale / v_scale (its
    k_pages / v_pages then are the dequantized pools the oracle reads)."""
    names = ("q", "stored_k", "stored_v") if "k_scale" in c else ("q", "k_pages", "v_pages")
    if not INTERPRET and c["q"].dtype == np.float32:   # compiled, wgmma takes 16-bit operands only
        c = dict(c, **{x: np.asarray(jnp.asarray(c[x], jnp.bfloat16)) for x in names if c[x].dtype == np.float32})
    args = [jnp.asarray(c[x]) for x in (*names, "page_table", "seq_lens", "query_start_loc")]
    out = paged_gpu.ragged_paged_attention(*args, max_q=c["max_q"], sm_scale=c["sm_scale"],
                                           sliding_window=c["sliding_window"], k_scale=c.get("k_scale"),
                                           v_scale=c.get("v_scale"), sinks=c.get("sinks"), interpret=INTERPRET,
                                           **blocks)
    assert out.shape == c["q"].shape and out.dtype == c["q"].dtype
    err = np.abs(np.asarray(out.astype(jnp.float32), np.float64) - paged_oracle(c)).max()
    assert err < TOL[np.dtype(c["q"].dtype).name], f"max abs err {err}"


@pytest.mark.parametrize("config", [(1, 2, 32, 16, "float32", None), (8, 2, 128, 16, "bfloat16", 37),
                                    (3, 1, 64, 32, "float32", 7)],  # 21 tokens in 63 of 64 rows
                         ids=lambda c: "g{}-kvh{}-d{}-ps{}-{}-w{}".format(*c))
def test_paged_kernel_mixed_batch(config, lowering):
    group, kvh, head_dim, page_size, dtype, window = config
    dtype = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    run_paged(paged_case(0, seqs=mixed_batch(page_size), num_kv_heads=kvh, group=group,
                         head_dim=head_dim, page_size=page_size, dtype=dtype, pad_tokens=3,
                         lead_tokens=2, sliding_window=window), lowering=lowering)


# Small blocks so that random batches cross q-block, sequence and KV-chunk boundaries.
@settings(max_examples=4, deadline=None)
@given(cases())
def test_paged_kernel_random_batches(spec):
    spec = dict(spec, dtype=jnp.bfloat16 if spec["dtype"] == "bfloat16" else np.float32)
    run_paged(paged_case(**spec))


# Quantized pools over 3 and more KV tiles (page and scale buffers refilled, barrier phases
# flipped) under the interpreter's race detector: int8 with 2 pages a tile, fp8 with 8 pages
# and 2 blocks of 64 rows a tile to dequantize. Slots no row may read get NaN scales, as a
# poisoned cache's freed pages and slots past a sequence's length hold them.
@pytest.mark.parametrize("kv_dtype, config", [("int8", (4, 2, 64, 32, jnp.bfloat16, None, 64)),
                                              ("fp8", (1, 1, 32, 16, np.float32, 37, 128))])
def test_paged_kernel_reads_quantized_pools_without_races(kv_dtype, config, lowering):
    group, kvh, head_dim, page_size, dtype, window, kv_block = config
    c = paged_case(1, seqs=[(1, 1), (0, 0), (5, 2 * page_size + 3), (1, 300)], num_kv_heads=kvh, group=group,
                   head_dim=head_dim, page_size=page_size, dtype=dtype, pad_tokens=2, sliding_window=window)
    (stored_k, k_scale, k_pages), (stored_v, v_scale, v_pages) = (
        quantized(jnp.asarray(c[x], jnp.float32), KV_CACHE_DTYPES[kv_dtype]) for x in ("k_pages", "v_pages"))
    k_scale, v_scale = (poison_unread(x, c["page_table"], c["seq_lens"], page_size) for x in (k_scale, v_scale))
    gpu_interpret.reset_gpu_interpret_mode_state()
    run_paged(dict(c, stored_k=stored_k, stored_v=stored_v, k_scale=k_scale, v_scale=v_scale, k_pages=k_pages,
                   v_pages=v_pages), kv_block=kv_block, lowering=lowering)
    assert not INTERPRET or not gpu_interpret.get_races().races_found


# Split KV: decodes whose tiles spread unevenly over the splits (the last ones short or empty:
# 1 tile among 3 or 4 splits), beside a prefill chunk, under the race detector; with the window
# some splits hold only tiles that some rows cannot see. None: the default, 2 splits here (5
# sequences x 2 KV heads are few programs; a page table of 38 pages holds 9 tiles of 64 keys).
# Sinks join once, at the merge of the splits. Each split count, window and sinks once: 3 splits
# with both.
@pytest.mark.parametrize("kv_splits, window, sinks", [(4, 100, False), (None, None, False), (3, 100, True)])
def test_paged_kernel_split_kv(kv_splits, window, sinks, lowering):
    c = paged_case(3, seqs=[(1, 1), (1, 600), (9, 200), (0, 0), (1, 130)], num_kv_heads=2, group=4, head_dim=64,
                   page_size=16, dtype=jnp.bfloat16, pad_tokens=2, sliding_window=window)
    if sinks:
        c["sinks"] = np.random.default_rng(4).uniform(-2.0, 4.0, 8).astype(np.float32)
    assert paged_gpu.pick_kv_splits(5 * 2, c["page_table"].shape[1] * 16 // 64) == 2
    gpu_interpret.reset_gpu_interpret_mode_state()
    run_paged(c, kv_splits=kv_splits, lowering=lowering)
    assert not INTERPRET or not gpu_interpret.get_races().races_found


def flash_against_reference(seq_len, *, head_dim, block_kv, **opts):
    # one head (races are within a CTA), bfloat16 (wgmma's, compiled)
    q, k, v = (jax.random.normal(key, (1, seq_len, 1, head_dim), jnp.bfloat16)
               for key in jax.random.split(jax.random.key(seq_len), 3))
    gpu_interpret.reset_gpu_interpret_mode_state()
    # Waited for before the eager reference (jaxserve/attention._waited_for: ops queued behind a
    # running interpreted kernel can hang it).
    out = jax.block_until_ready(flash_gpu.flash_attention(q, k, v, block_kv=block_kv, interpret=INTERPRET, **opts))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = causal_attention(f32(q), f32(k), f32(v), sm_scale=head_dim ** -0.5, **opts)
    err = float(jnp.abs(f32(out) - ref).max())
    assert err < TOL["bfloat16"], f"max abs error {err}"
    # Races need a missing barrier wait: with 2 or fewer kv blocks the barrier phases alone do
    # not show one (the slot is never reused). Shown to fire on kernels without their waits.
    assert not INTERPRET or not gpu_interpret.get_races().races_found


# A 320-token prompt, kv blocks of 64: the last q block visits 5 kv blocks (6 compiled, where q
# blocks default to 128 rows), so each K/V slot is refilled and its barriers complete 2-3 phases.
# Causal (FULL tiles, then PARTIAL ones) at head_dim 256, whose default kv block is 64 (128 would
# overflow shared memory); bidirectional (FULL tiles alone) at 64. With a window and soft cap
# (and ALiBi, sinks): test_flash_attention.py's test_gpu_kernel_one_warpgroup_reuses_kv_slots.
@pytest.mark.parametrize("head_dim, block_kv, causal", [(256, None, True), (64, 64, False)],
                         ids=["causal-head_dim_256", "bidirectional"])
def test_flash_kernel_over_many_kv_blocks(head_dim, block_kv, causal):
    assert flash_gpu.pick_block_kv(256, jnp.bfloat16) == 64
    flash_against_reference(320, head_dim=head_dim, block_kv=block_kv, causal=causal)


# Mosaic GPU checks a kernel's shared memory against the H100's 227 KB when lowering (no device
# needed); `fits`, which attention.py asks before taking the flash path, must agree with it.
@pytest.mark.parametrize("head_dim, block_kv", [(128, 128), (192, 64), (192, 128), (256, 64),
                                                (256, 128)])
def test_flash_smem_budget_matches_mosaic_gpu(head_dim, block_kv):
    q = jax.ShapeDtypeStruct((1, 256, 1, head_dim), jnp.bfloat16)
    fn = jax.jit(lambda q, k, v: flash_gpu.flash_attention(q, k, v, block_kv=block_kv))
    expected = flash_gpu.smem_bytes(head_dim, jnp.bfloat16, block_kv=block_kv) <= flash_gpu.SMEM_BUDGET
    try:
        fn.trace(q, q, q).lower(lowering_platforms=("cuda",))
        lowered = True
    except ValueError as e:
        assert "exceeds available shared memory" in str(e)
        lowered = False
    assert lowered == expected
    assert flash_gpu.fits(head_dim, jnp.bfloat16)  # with block_kv 64
    assert not flash_gpu.fits(head_dim, jnp.float32) and not flash_gpu.fits(head_dim + 32, jnp.bfloat16)


def test_flash_fits_refuses_head_dims_past_wgmma():
    q = jax.ShapeDtypeStruct((1, 256, 1, 320), jnp.bfloat16)  # fits shared memory: 64 q rows, 64 kv rows
    with pytest.raises(ValueError, match="N must be a multiple of 8 and <= 256"):
        jax.jit(lambda q: flash_gpu.flash_attention(q, q, q, block_q=64, block_kv=64)).trace(q).lower(
            lowering_platforms=("cuda",))
    assert not flash_gpu.fits(320, jnp.bfloat16)


def test_auto_backend_serves_with_xla_where_the_paged_kernel_refuses():
    """Latent attention's 576-dim head is past wgmma's 256, and a quantized pool's head_dim must
    be a multiple of 32: the paged kernel refuses them, so on a GPU `auto` serves such a model
    through the XLA path instead of failing at warm-up; a TPU pads them and takes them."""
    q = jax.ShapeDtypeStruct((8, 16, 576), jnp.bfloat16)
    pages = jax.ShapeDtypeStruct((4, 1, 16, 576), jnp.bfloat16)
    table, lens, qsl = (jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2, 2), (2,), (3,)))
    with pytest.raises(ValueError, match="head_dim 576"):
        jax.jit(lambda *a: paged_gpu.ragged_paged_attention(*a, max_q=4, sm_scale=0.1)).trace(
            q, pages, None, table, lens, qsl)
    assert [resolve_backend("auto", "gpu", d, kv) for d, kv in ((128, "auto"), (576, "auto"), (80, "auto"),
                                                                  (80, "int8"), (96, "fp8"))] == [
        "pallas_gpu", "xla", "pallas_gpu", "xla", "pallas_gpu"]
    assert resolve_backend("auto", "tpu", 576, "int8") == "pallas_tpu"
    assert resolve_backend("pallas_gpu", "gpu", 576) == "pallas_gpu"   # named: the kernel says why not
