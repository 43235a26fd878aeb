"""Ragged paged attention: the XLA reference and the Pallas kernels (interpret mode on CPU)
against a deliberately naive numpy oracle (one token, one head at a time): mixed batches in
several head / page / dtype / window configs, soft cap with ALiBi and sinks, quantized pools
(NaN scales where no row may read), random batches, lowering for the real chips; and `attend`
(the flash kernel for leading fresh prefill rows, the paged kernel for the rest) on plain,
quantized and lane-padded pools."""
import importlib
import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxserve import attention, kv_cache, quantization
from pallas_kernels.paged_attention import gpu, reference, tpu, xla

TOL = {"float32": 2e-3, "bfloat16": 2e-2}


def naive_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *, sm_scale,
                    sliding_window=None, soft_cap=None, alibi_slopes=None, sinks=None):
    """float64, per sequence, per token, per head. Tokens outside
    [query_start_loc[0], query_start_loc[-1]) stay 0. ALiBi as its paper writes it: the bias
    -slope * (query position - key position). Sinks as gpt-oss (transformers) writes them: one
    more logit column in the softmax, dropped from the weights."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    page_size, group = k_pages.shape[2], q.shape[1] // k_pages.shape[1]
    out = np.zeros_like(q)
    for s in range(len(seq_lens)):
        start, end, kv_len = query_start_loc[s], query_start_loc[s + 1], seq_lens[s]
        kv_pos = np.arange(kv_len)
        pages = page_table[s][kv_pos // page_size]
        k, v = k_pages[pages, :, kv_pos % page_size], v_pages[pages, :, kv_pos % page_size]  # [kv_len, KVH, D]
        for t in range(start, end):
            pos = kv_len - (end - start) + (t - start)
            seen = kv_pos <= pos
            if sliding_window is not None:
                seen &= kv_pos > pos - sliding_window
            for h in range(q.shape[1]):
                scores = k[seen, h // group] @ q[t, h] * sm_scale
                if soft_cap is not None:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                if alibi_slopes is not None:
                    scores = scores - float(alibi_slopes[h]) * (pos - kv_pos[seen])
                logits = scores if sinks is None else np.append(scores, float(sinks[h]))
                w = np.exp(logits - logits.max())
                out[t, h] = (w / w.sum())[:len(scores)] @ v[seen, h // group]
    return out


def make_case(seed, *, seqs, num_kv_heads, group, head_dim, page_size, dtype, pad_tokens=0,
              lead_tokens=0, sliding_window=None, soft_cap=None, alibi=False, sinks=False, num_pages=None):
    """seqs: one (q_len, kv_len) per batch slot, (0, 0) for an empty slot. Pages are scattered
    at random through a pool that also holds unused random pages, so reading a wrong page shows.
    lead_tokens: tokens before query_start_loc[0] (another call's; output 0), pad_tokens: after.
    alibi: random ALiBi slopes, a different one per query head; sinks: random sink logits, as
    large as the scores' softmax weights (some above, some below every score). num_pages: the
    pool's (default: the pages needed and 3 more)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(1, max(math.ceil(kv / page_size) for _, kv in seqs))
    needed = sum(math.ceil(kv / page_size) for _, kv in seqs)
    num_pages = num_pages or needed + 3
    perm = rng.permutation(num_pages)
    # Unused page-table entries point at random pages: a kernel must never let them matter.
    page_table = rng.integers(0, num_pages, (len(seqs), pages_per_seq)).astype(np.int32)
    used = 0
    for s, (_, kv) in enumerate(seqs):
        n = math.ceil(kv / page_size)
        page_table[s, :n] = perm[used:used + n]
        used += n
    q_lens = np.array([ql for ql, _ in seqs], np.int32)
    total = int(q_lens.sum())
    pad_tokens = max(pad_tokens, int(lead_tokens + total == 0))  # a batch has at least one token
    shape_kv, heads = (num_pages, num_kv_heads, page_size, head_dim), num_kv_heads * group
    return dict(
        q=jnp.asarray(rng.standard_normal((lead_tokens + total + pad_tokens, heads, head_dim)), dtype),
        k_pages=jnp.asarray(rng.standard_normal(shape_kv), dtype),
        v_pages=jnp.asarray(rng.standard_normal(shape_kv), dtype),
        page_table=jnp.asarray(page_table), seq_lens=jnp.asarray(np.array([kv for _, kv in seqs], np.int32)),
        query_start_loc=jnp.asarray(lead_tokens + np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        sm_scale=head_dim ** -0.5, sliding_window=sliding_window, max_q=max(1, int(q_lens.max())), soft_cap=soft_cap,
        alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.5, heads), jnp.float32) if alibi else None,
        sinks=jnp.asarray(rng.uniform(-2.0, 4.0, heads), jnp.float32) if sinks else None)


def oracle(case):
    return naive_attention(
        case["q"], case["k_pages"], case["v_pages"], np.asarray(case["page_table"]),
        np.asarray(case["seq_lens"]), np.asarray(case["query_start_loc"]),
        sm_scale=case["sm_scale"], sliding_window=case["sliding_window"], soft_cap=case["soft_cap"],
        alibi_slopes=None if case["alibi_slopes"] is None else np.asarray(case["alibi_slopes"]),
        sinks=None if case["sinks"] is None else np.asarray(case["sinks"]))


def args(case):
    return tuple(case[x] for x in ("q", "k_pages", "v_pages", "page_table", "seq_lens", "query_start_loc"))


def assert_close(out, case):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    err = np.abs(out - oracle(case)).max()
    assert err < TOL[jnp.dtype(case["q"].dtype).name], f"max abs err {err}"


# Batch slots covering every case: q_len 1, kv_len 1, exact page multiples, an empty slot,
# decode, prefill chunks after cached context, a whole prompt, KV longer than the kernels' default
# KV chunks (256 keys on TPU, 64 on GPU).
def mixed_batch(ps):
    return [(1, 1), (0, 0), (1, ps), (ps, ps), (3, 2 * ps), (ps + 1, 4 * ps + 3), (1, 257 + ps), (2 * ps, 2 * ps)]


CONFIGS = [  # (group, num_kv_heads, head_dim, page_size, dtype, sliding_window)
    (1, 2, 64, 16, "float32", None), (4, 1, 128, 32, "bfloat16", 37),
    (8, 1, 64, 32, "float32", 7), (8, 2, 128, 16, "bfloat16", None)]
CONFIG_ID = "g{}-kvh{}-d{}-ps{}-{}-w{}".format


def dispatch(case, backend, **meta):
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=None, page_table=case["page_table"], seq_lens=case["seq_lens"],
        query_start_loc=case["query_start_loc"], max_q=case["max_q"], backend=backend, **meta)
    return attention.paged_attention(case["q"], kv_cache.LayerKV(case["k_pages"], case["v_pages"]), meta,
                                     **{x: case[x] for x in ("sliding_window", "sm_scale", "soft_cap", "alibi_slopes",
                                                             "sinks")})


# Every config on the XLA path. The TPU kernel's other two: with quantized pools (test_paged_paths_read_...
# below); the GPU kernel's group 1, 8, head_dim 64, 128: test_gpu_kernels.py's test_paged_kernel_mixed_batch.
DISPATCH = [("xla", c) for c in CONFIGS] + [("pallas_tpu", c) for c in CONFIGS[2:]] + [("pallas_gpu", CONFIGS[1])]


@pytest.mark.parametrize("backend, config", DISPATCH, ids=[f"{b}-{CONFIG_ID(*c)}" for b, c in DISPATCH])
def test_dispatch_matches_oracle_and_reference(backend, config):
    group, kvh, head_dim, page_size, dtype, window = config
    case = make_case(0, seqs=mixed_batch(page_size), num_kv_heads=kvh, group=group,
                     head_dim=head_dim, page_size=page_size, dtype=dtype, pad_tokens=3,
                     sliding_window=window)
    out = dispatch(case, backend)
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    assert_close(out, case)
    assert not np.asarray(out[int(case["query_start_loc"][-1]):]).any(), "padding tokens must be 0"
    if backend != "xla":
        diff = jnp.abs(out.astype(jnp.float32) - dispatch(case, "xla").astype(jnp.float32)).max()
        assert diff < TOL[dtype], f"differs from the XLA reference by {diff}"


# Gemma 2's tanh cap (1.5 bites: these scores reach a few units) with ALiBi, with sinks, and with both (no
# model has both; the sink raised by slope x query position: scores.py; without it, errors of 1.5 here).
SCORE_MODS = {"soft_cap+alibi": dict(soft_cap=1.5, alibi=True), "soft_cap+sinks": dict(soft_cap=1.5, sinks=True),
              "soft_cap+alibi+sinks": dict(soft_cap=1.5, alibi=True, sinks=True)}


def assert_each_modifier_matters(case):
    """Without any one of its modifiers the oracle moves far past the tolerance (a path dropping it fails)."""
    want = oracle(case)
    for name in ("soft_cap", "alibi_slopes", "sinks"):
        if case[name] is not None:
            assert np.abs(oracle(dict(case, **{name: None})) - want).max() > 0.01, name


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("mods", sorted(SCORE_MODS))
def test_soft_cap_alibi_and_sinks_in_every_path(backend, mods):
    """Soft cap, ALiBi and attention sinks through every backend's paged kernel, and the jnp
    reference; tokens of no row before and after the rows' see no key and give 0."""
    case = make_case(2, seqs=[(5, 20), (1, 9), (16, 16), (1, 33), (1, 70)], num_kv_heads=2, group=2, head_dim=64,
                     page_size=16, dtype="float32", sliding_window=50, lead_tokens=2, pad_tokens=3, **SCORE_MODS[mods])
    assert_each_modifier_matters(case)
    out = dispatch(case, backend)
    assert_close(out, case)
    first, end = int(case["query_start_loc"][0]), int(case["query_start_loc"][-1])
    assert not np.asarray(out[:first]).any() and not np.asarray(out[end:]).any(), "tokens of no row must be 0"
    if backend == "xla":
        assert_close(reference.ragged_paged_attention_xla(
            *args(case), max_q=16, sm_scale=case["sm_scale"], sliding_window=50, soft_cap=case["soft_cap"],
            alibi_slopes=case["alibi_slopes"], sinks=case["sinks"]), case)


def test_xla_dispatch_pads_decode_rows_separately():
    # As the runner packs a batch: prefill rows first, then rows of at most one token each.
    case = make_case(1, seqs=[(5, 20), (16, 16), (1, 9), (0, 0), (1, 33)], num_kv_heads=2, group=4,
                     head_dim=64, page_size=16, dtype="float32", pad_tokens=2, sliding_window=9)
    assert_close(dispatch(case, "xla", num_prefill_rows=2), case)
    assert_close(dispatch(case, "xla", num_prefill_rows=5), case)


@st.composite
def cases(draw):
    page_size = draw(st.sampled_from([16, 32]))
    kv_lens = st.one_of(st.sampled_from([1, page_size - 1, page_size, page_size + 1, 2 * page_size]),
                        st.integers(1, 5 * page_size + 7))
    seqs = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["empty", "decode", "prefill", "chunk"]))
        if kind == "empty":
            seqs.append((0, 0))
            continue
        kv = draw(kv_lens)
        q_len = {"decode": 1, "prefill": kv}.get(kind) or draw(st.integers(1, kv))
        seqs.append((q_len, kv))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)), seqs=seqs, num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 4, 8])), head_dim=draw(st.sampled_from([64, 128])), page_size=page_size,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])), pad_tokens=draw(st.integers(0, 3)),
        lead_tokens=draw(st.sampled_from([0, 0, 0, 2])),
        sliding_window=draw(st.sampled_from([None, None, 1, 7, page_size, 2 * page_size + 5])))


@settings(max_examples=10, deadline=None)
@given(cases())
def test_xla_reference_matches_naive_oracle(spec):
    case = make_case(**spec)
    assert_close(reference.ragged_paged_attention_xla(*args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
                                                      sliding_window=case["sliding_window"]), case)


# Blocks of one or two pages: random batches cross block, window and sequence boundaries.
@settings(max_examples=10, deadline=None)
@given(cases(), st.sampled_from([1, 2]))
def test_blockwise_xla_path_matches_naive_oracle(spec, block_pages):
    case = make_case(**spec)
    assert_close(xla.ragged_paged_attention(*args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
                                            sliding_window=case["sliding_window"],
                                            block_tokens=block_pages * spec["page_size"]), case)


# Small blocks (4 to 32 tokens) so that random batches cross q-block, sequence and KV-chunk boundaries.
@settings(max_examples=4, deadline=None)
@given(cases())
def test_tpu_kernel_random_batches(spec):
    case = make_case(**spec)
    assert_close(tpu.ragged_paged_attention(*args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
                                            sliding_window=case["sliding_window"], block_rows=32, kv_block=128,
                                            interpret=True), case)


# The interpreters skip the Mosaic / Triton lowerings; lowering for the real platform (no device
# needed) catches kernels that interpret fine but use what the compilers reject.
@pytest.mark.parametrize("kernel, platform", [(tpu, "tpu"), (gpu, "cuda")], ids=["tpu", "gpu"])
def test_kernels_lower_for_their_platform(kernel, platform):
    wide = "bfloat16" if platform == "cuda" else "float32"  # wgmma takes 16-bit operands only
    for dtype, window in [("bfloat16", None), (wide, 7)]:
        case = make_case(0, seqs=mixed_batch(16), num_kv_heads=2, group=4, head_dim=128,
                         page_size=16, dtype=dtype, sliding_window=window)
        text = kernel.ragged_paged_attention.trace(
            *args(case), max_q=case["max_q"], sm_scale=case["sm_scale"], sliding_window=window,
        ).lower(lowering_platforms=(platform,)).as_text()
        assert {"tpu": "tpu_custom_call", "cuda": "mosaic_gpu"}[platform] in text


# The Pallas backends' flash path for prefill rows: `attend` writes the new K/V into the pages
# and runs the leading prefill rows without a cached prefix through the flash kernel. Each step
# has 27 tokens (32 with padding) and the same pool: one compilation of each kernel serves all three.
FRESH = [(20, 20), (5, 5), (0, 0), (1, 40), (1, 1), (0, 0)]   # 3 prefill rows (1 padding), decodes
CACHED = [(20, 20), (5, 37), (0, 0), (1, 40), (1, 1), (0, 0)]  # row 1: 32 tokens already cached
# Row 2 is fresh but follows a cached row (the runner puts fresh rows first): the paged kernel's.
MIXED = [(14, 14), (5, 37), (6, 6), (1, 40), (1, 1), (0, 0)]


def attend_case(seqs, backend, sliding_window=None, pool_head_dim=64, kv_dtype="auto", values_are_keys=False,
                **mods):
    """attend() on a runner-style step (prefill rows first): returns (output, case with the
    written pages), for the naive oracle. pool_head_dim > 64: pools with zero lanes past head_dim
    64, as TPU pools store them (kv_cache.pool_head_dim); the returned pages are cut back to 64.
    kv_dtype int8 / fp8: quantized pools, scales in 128 lanes (NaN past page_size 16) as a TPU
    stores them; the returned pages are the written ones dequantized. values_are_keys: no V pool
    (latent attention): the new K is V too, and the returned V pages are the K pages."""
    case = make_case(2, seqs=seqs, num_kv_heads=2, group=2, head_dim=64, page_size=16,
                     dtype="float32", pad_tokens=5, sliding_window=sliding_window, num_pages=16, **mods)
    rng = np.random.default_rng(3)
    t, ps, num_pages = case["q"].shape[0], 16, case["k_pages"].shape[0]
    qsl, table = np.asarray(case["query_start_loc"]), np.asarray(case["page_table"])
    slots = np.full(t, num_pages * ps, np.int32)  # padding: not written
    for s, (q_len, kv_len) in enumerate(seqs):
        pos = np.arange(kv_len - q_len, kv_len)
        slots[qsl[s]:qsl[s + 1]] = table[s, pos // ps] * ps + pos % ps
    k, v = (jnp.asarray(rng.standard_normal((t, 2, 64)), jnp.float32) for _ in range(2))
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=jnp.asarray(slots), page_table=case["page_table"],
        seq_lens=case["seq_lens"], query_start_loc=case["query_start_loc"], max_q=32,
        num_prefill_rows=3, backend=backend)
    lanes = ((0, 0),) * 3 + ((0, pool_head_dim - 64),)
    pools = kv_cache.LayerKV(*(jnp.pad(case[name], lanes) for name in ("k_pages", "v_pages")))
    if kv_dtype != "auto":
        (k_pool, k_scale, _), (v_pool, v_scale, _) = (quantized(x, kv_cache.KV_CACHE_DTYPES[kv_dtype], lanes=128)
                                                      for x in (pools.k, pools.v))
        pools = kv_cache.LayerKV(k_pool, v_pool, k_scale, v_scale)
    if values_are_keys:
        v, pools = k, pools.replace(v=None, v_scale=None)
    out, written = attention.attend(case["q"], k, v, pools, meta, sliding_window=sliding_window,
                                               sm_scale=case["sm_scale"], soft_cap=case["soft_cap"],
                                               alibi_slopes=case["alibi_slopes"], sinks=case["sinks"])
    if values_are_keys:   # K alone written
        assert written.v is None
        written = written.replace(v=written.k, v_scale=written.k_scale)
    k_pages, v_pages = written.k, written.v
    if kv_dtype != "auto":
        k_pages, v_pages = (np.asarray(x, np.float64) * slot_scales(scale, ps)[..., None]
                            for x, scale in ((k_pages, written.k_scale), (v_pages, written.v_scale)))
    assert k_pages.shape[-1] == pool_head_dim and not np.asarray(k_pages[..., 64:]).any()
    return out, dict(case, k_pages=k_pages[..., :64], v_pages=v_pages[..., :64])


# Each modifier set once on the Pallas backends (the TPU's ALiBi with sinks: its flash and paged kernels'
# positions): attend hands both kernels ALiBi and sinks alike; test_flash_attention.py checks each with each.
ATTEND = [("xla", m) for m in SCORE_MODS] + [("pallas_tpu", "soft_cap+alibi+sinks"), ("pallas_gpu", "soft_cap+sinks")]


@pytest.mark.parametrize("backend, mods", ATTEND)
def test_attend_rows_match_oracle(monkeypatch, backend, mods):
    """Steps through attend with a window, soft cap and ALiBi or sinks. On the Pallas backends the
    leading fresh prefill rows take the flash kernel, shifted by 1 here: their tokens, and no
    other, must show the shift; the other rows take the paged kernel. Every token against the
    oracle (and the XLA path's prefill and decode rows)."""
    if backend != "xla":
        flash = importlib.import_module(f"pallas_kernels.flash_attention.{backend.removeprefix('pallas_')}")
        real = flash.flash_attention
        monkeypatch.setattr(flash, "flash_attention", lambda *a, **k: real(*a, **k) + 1)
    for seqs, flashed_rows in ((FRESH, 2), (CACHED, 1), (MIXED, 1)):
        out, case = attend_case(seqs, backend, sliding_window=7, **SCORE_MODS[mods])
        if seqs is MIXED:   # flash, paged prefill and decode rows
            assert_each_modifier_matters(case)
        end = int(case["query_start_loc"][flashed_rows]) if backend != "xla" else 0
        assert_close(out.at[:end].add(-1), case)


# The TPU's paths (pools padded to 128 lanes, as TPUs store them), the Pallas kernel in one dtype:
# the paged kernels' reads of either (and the GPU kernel's) are tested on their own, below and in
# test_gpu_kernels.py; writing and the flash path's quantized K/V are the same code on every backend.
@pytest.mark.parametrize("backend, kv_dtype", [("xla", "int8"), ("xla", "fp8"), ("pallas_tpu", "fp8")])
def test_attend_into_quantized_pools_matches_their_dequantized_oracle(backend, kv_dtype):
    """A step writing into quantized pools, fresh rows (flash on the Pallas backend: fed the new
    K/V as the pools hold them) and cached ones, against the written pools dequantized; pools
    padded to 128 lanes give the unpadded attention."""
    for seqs in (FRESH, CACHED):
        out, case = attend_case(seqs, backend, kv_dtype=kv_dtype, pool_head_dim=128)
        assert out.shape[-1] == 64
        assert_close(out, case)


def quantized(pages, dtype, lanes=None):
    """A [N, KVH, ps, D] pool through quantization.quantize_rows (per slot and head): (stored, scales as
    kv_cache.py lays them out, [N, KVH, 1, lanes], the dequantized pool in float64 for the
    oracle). lanes > ps (a TPU's whole 128): the lanes past ps hold NaN, which no path may read."""
    n, kvh, ps, d = pages.shape
    stored, scale = quantization.quantize_rows(pages.transpose(0, 2, 1, 3).reshape(n * ps, kvh, d), dtype)
    stored = stored.reshape(n, ps, kvh, d).transpose(0, 2, 1, 3)
    scale = scale.reshape(n, ps, kvh).transpose(0, 2, 1)
    deq = np.asarray(stored, np.float64) * np.asarray(scale, np.float64)[..., None]
    scale = jnp.pad(scale[:, :, None], ((0, 0), (0, 0), (0, 0), (0, (lanes or ps) - ps)), constant_values=np.nan)
    return stored, scale, deq


def poison_unread(scale, page_table, seq_lens, page_size):
    """Scales [N, KVH, 1, lanes] with NaN wherever no row may read, as a poisoned cache holds them
    (tests/test_kv_isolation.py): in pages of no sequence, and in each sequence's last page past
    its length."""
    unread = np.ones((scale.shape[0], scale.shape[-1]), bool)
    for s, n in enumerate(np.asarray(seq_lens)):
        pos = np.arange(n)
        unread[np.asarray(page_table)[s, pos // page_size], pos % page_size] = False
    return jnp.where(unread[:, None, None, :], np.nan, scale)


def slot_scales(scale_pool, page_size):
    """[N, KVH, 1, lanes] scales -> float64 [N, KVH, page_size]."""
    return np.asarray(scale_pool, np.float64)[:, :, 0, :page_size]


# The XLA path in every config and dtype; the TPU kernel in each config and dtype once (the GPU
# kernel's: test_gpu_kernels.py).
QUANTIZED = ([("xla", kv, c) for kv in ("int8", "fp8") for c in CONFIGS[:2]]
             + [("pallas_tpu", "int8", CONFIGS[0]), ("pallas_tpu", "fp8", CONFIGS[1])])


@pytest.mark.parametrize("backend, kv_dtype, config", QUANTIZED,
                         ids=[f"{b}-{kv}-{CONFIG_ID(*c)}" for b, kv, c in QUANTIZED])
def test_paged_paths_read_quantized_pools_through_their_scales(backend, kv_dtype, config):
    """Int8 / fp8 pools with per-slot scales give the attention of the dequantized pools (naive
    oracle), and NaN scales where no row may read (a freed page, a page's slots past its
    sequence's length) change nothing."""
    group, kvh, head_dim, page_size, dtype, window = config
    case = make_case(5, seqs=mixed_batch(page_size), num_kv_heads=kvh, group=group, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, pad_tokens=3, sliding_window=window)
    storage = kv_cache.KV_CACHE_DTYPES[kv_dtype]
    lanes = kv_cache.scale_lanes(page_size, "tpu")   # as TPU pools hold them (both paths run on TPUs)
    (k, k_scale, k_deq), (v, v_scale, v_deq) = (quantized(case[name], storage, lanes) for name in ("k_pages", "v_pages"))
    # The quantization is as fine as the dtype allows: int8 half a step of the scale; e4m3 half a
    # unit in the last of 3 mantissa bits, or half its subnormal step (2^-9 x scale)
    pages, step = np.asarray(case["k_pages"], np.float64), slot_scales(k_scale, page_size)[..., None]
    bound = step / 2 if kv_dtype == "int8" else np.abs(pages) * 2.0 ** -4 + step * 2.0 ** -10
    assert np.all(np.abs(k_deq - pages) <= bound * (1 + 1e-6) + 1e-7)
    k_scale, v_scale = (poison_unread(x, case["page_table"], case["seq_lens"], page_size) for x in (k_scale, v_scale))
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=None, page_table=case["page_table"], seq_lens=case["seq_lens"],
        query_start_loc=case["query_start_loc"], max_q=case["max_q"], backend=backend)
    assert_close(attention.paged_attention(case["q"], kv_cache.LayerKV(k, v, k_scale, v_scale), meta,
                                           sliding_window=window, sm_scale=case["sm_scale"]),
                 dict(case, k_pages=k_deq, v_pages=v_deq))
