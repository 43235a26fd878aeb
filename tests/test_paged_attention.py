"""Ragged paged attention: the XLA reference and the Pallas kernels (interpret mode on CPU)
against a deliberately naive numpy oracle (one token, one head at a time)."""
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
    num_kv_heads, page_size = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // num_kv_heads
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
              lead_tokens=0, sliding_window=None, soft_cap=None, alibi=False, sinks=False):
    """seqs: one (q_len, kv_len) per batch slot, (0, 0) for an empty slot. Pages are scattered
    at random through a pool that also holds unused random pages, so reading a wrong page shows.
    lead_tokens: tokens before query_start_loc[0] (another call's; output 0), pad_tokens: after.
    alibi: random ALiBi slopes, a different one per query head; sinks: random sink logits, as
    large as the scores' softmax weights (some above, some below every score)."""
    rng = np.random.default_rng(seed)
    pages_per_seq = max(1, max(math.ceil(kv / page_size) for _, kv in seqs))
    needed = sum(math.ceil(kv / page_size) for _, kv in seqs)
    num_pages = needed + 3
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
    shape_kv = (num_pages, num_kv_heads, page_size, head_dim)
    return dict(
        q=jnp.asarray(rng.standard_normal((lead_tokens + total + pad_tokens, num_kv_heads * group,
                                           head_dim)), dtype),
        k_pages=jnp.asarray(rng.standard_normal(shape_kv), dtype),
        v_pages=jnp.asarray(rng.standard_normal(shape_kv), dtype),
        page_table=jnp.asarray(page_table),
        seq_lens=jnp.asarray(np.array([kv for _, kv in seqs], np.int32)),
        query_start_loc=jnp.asarray(lead_tokens + np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)),
        sm_scale=head_dim ** -0.5,
        sliding_window=sliding_window,
        max_q=max(1, int(q_lens.max())),
        soft_cap=soft_cap,
        alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.5, num_kv_heads * group), jnp.float32) if alibi else None,
        sinks=jnp.asarray(rng.uniform(-2.0, 4.0, num_kv_heads * group), jnp.float32) if sinks else None,
    )


def oracle(case):
    return naive_attention(
        case["q"], case["k_pages"], case["v_pages"], np.asarray(case["page_table"]),
        np.asarray(case["seq_lens"]), np.asarray(case["query_start_loc"]),
        sm_scale=case["sm_scale"], sliding_window=case["sliding_window"], soft_cap=case["soft_cap"],
        alibi_slopes=None if case["alibi_slopes"] is None else np.asarray(case["alibi_slopes"]),
        sinks=None if case["sinks"] is None else np.asarray(case["sinks"]))


def args(case):
    return (case["q"], case["k_pages"], case["v_pages"], case["page_table"], case["seq_lens"],
            case["query_start_loc"])


def assert_close(out, case):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    err = np.abs(out - oracle(case)).max()
    assert err < TOL[jnp.dtype(case["q"].dtype).name], f"max abs err {err}"


# Batch slots covering every case: q_len 1, kv_len 1, exact page multiples, an empty slot,
# decode, prefill chunks after cached context, a whole prompt, KV longer than the kernels' default
# KV chunks (256 keys on TPU, 64 on GPU).
def mixed_batch(page_size):
    ps = page_size
    return [(1, 1), (0, 0), (1, ps), (ps, ps), (3, 2 * ps), (ps + 1, 4 * ps + 3), (1, 257 + ps),
            (2 * ps, 2 * ps)]


CONFIGS = [  # (group, num_kv_heads, head_dim, page_size, dtype, sliding_window)
    (1, 2, 64, 16, "float32", None),
    (4, 1, 128, 32, "bfloat16", 37),
    (8, 1, 64, 32, "float32", 7),
    (8, 2, 128, 16, "bfloat16", None),
]


def dispatch(case, backend, **meta):
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=None, page_table=case["page_table"], seq_lens=case["seq_lens"],
        query_start_loc=case["query_start_loc"], max_q=case["max_q"], backend=backend, **meta)
    return attention.paged_attention(case["q"], kv_cache.LayerKV(case["k_pages"], case["v_pages"]), meta,
                                     sliding_window=case["sliding_window"], sm_scale=case["sm_scale"],
                                     soft_cap=case["soft_cap"], alibi_slopes=case["alibi_slopes"],
                                     sinks=case["sinks"])


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "g{}-kvh{}-d{}-ps{}-{}-w{}".format(*c))
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


SCORE_MODS = {"soft_cap": dict(soft_cap=1.5), "alibi": dict(alibi=True), "both": dict(soft_cap=1.5, alibi=True),
              "sinks": dict(sinks=True)}


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("mods", sorted(SCORE_MODS))
def test_soft_cap_and_alibi_in_every_path(backend, mods):
    """Gemma 2's tanh cap (1.5 bites: these scores reach a few units), ALiBi and attention sinks
    through every backend's paged kernel, and the jnp reference; tokens of no row before and after
    the rows' see no key and give 0."""
    case = make_case(2, seqs=[(5, 20), (1, 9), (16, 16), (1, 33), (1, 70)], num_kv_heads=2, group=2, head_dim=64,
                     page_size=16, dtype="float32", sliding_window=50, lead_tokens=2, pad_tokens=3,
                     **SCORE_MODS[mods])
    plain = oracle(dict(case, soft_cap=None, alibi_slopes=None, sinks=None))
    assert np.abs(oracle(case) - plain).max() > 0.01   # the modifiers matter
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
        seed=draw(st.integers(0, 2**31 - 1)),
        seqs=seqs,
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 4, 8])),
        head_dim=draw(st.sampled_from([64, 128])),
        page_size=page_size,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        pad_tokens=draw(st.integers(0, 3)),
        lead_tokens=draw(st.sampled_from([0, 0, 0, 2])),
        sliding_window=draw(st.sampled_from([None, None, 1, 7, page_size, 2 * page_size + 5])),
    )


@settings(max_examples=10, deadline=None)
@given(cases())
def test_xla_reference_matches_naive_oracle(spec):
    case = make_case(**spec)
    out = reference.ragged_paged_attention_xla(
        *args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
        sliding_window=case["sliding_window"])
    assert_close(out, case)


# Blocks of one or two pages: random batches cross block, window and sequence boundaries.
@settings(max_examples=10, deadline=None)
@given(cases(), st.sampled_from([1, 2]))
def test_blockwise_xla_path_matches_naive_oracle(spec, block_pages):
    case = make_case(**spec)
    out = xla.ragged_paged_attention(
        *args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
        sliding_window=case["sliding_window"], block_tokens=block_pages * spec["page_size"])
    assert_close(out, case)


# Small blocks so that random batches cross q-block, sequence and KV-chunk boundaries.
@settings(max_examples=4, deadline=None)
@given(cases())
def test_tpu_kernel_random_batches(spec):
    case = make_case(**spec)
    out = tpu.ragged_paged_attention(
        *args(case), max_q=case["max_q"], sm_scale=case["sm_scale"],
        sliding_window=case["sliding_window"], block_rows=8, kv_block=128, interpret=True)
    assert_close(out, case)


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
# and runs the leading prefill rows without a cached prefix through the flash kernel.
FRESH = [(20, 20), (5, 5), (0, 0), (1, 40), (1, 1), (0, 0)]   # 3 prefill rows (1 padding), decodes
CACHED = [(20, 20), (5, 37), (0, 0), (1, 40), (1, 1), (0, 0)]  # row 1: 32 tokens already cached
# Row 2 is fresh but follows a cached row (the runner puts fresh rows first): the paged kernel's.
MIXED = [(20, 20), (5, 37), (6, 6), (1, 40), (1, 1), (0, 0)]


def attend_case(seqs, backend, sliding_window=None, pool_head_dim=64, kv_dtype="auto", values_are_keys=False,
                **mods):
    """attend() on a runner-style step (prefill rows first): returns (output, case with the
    written pages), for the naive oracle. pool_head_dim > 64: pools with zero lanes past head_dim
    64, as TPU pools store them (kv_cache.pool_head_dim); the returned pages are cut back to 64.
    kv_dtype int8 / fp8: quantized pools, scales in 128 lanes (NaN past page_size 16) as a TPU
    stores them; the returned pages are the written ones dequantized. values_are_keys: no V pool
    (latent attention): the new K is V too, and the returned V pages are the K pages."""
    case = make_case(2, seqs=seqs, num_kv_heads=2, group=2, head_dim=64, page_size=16,
                     dtype="float32", pad_tokens=5, sliding_window=sliding_window, **mods)
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


@pytest.mark.parametrize("backend, mods", [(b, m) for b in ("pallas_tpu", "pallas_gpu")
                                          for m in ("none", "both", "sinks")] + [("xla", "sinks")])
def test_attend_prefill_rows_match_oracle(backend, mods):
    """Flash (leading fresh prefill rows) and paged (the rest), with soft cap and ALiBi, or sinks
    (and the XLA path's prefill and decode rows with sinks)."""
    out, case = attend_case(MIXED, backend, sliding_window=7, **SCORE_MODS.get(mods, {}))
    assert_close(out, case)


# pallas_gpu: int8 only (50 s in interpret mode); its kernel's fp8 path: test_gpu_kernels.py.
@pytest.mark.parametrize("backend, kv_dtype", [(b, kv) for b in ("xla", "pallas_tpu") for kv in ("int8", "fp8")]
                         + [("pallas_gpu", "int8")])
def test_attend_into_quantized_pools_matches_their_dequantized_oracle(backend, kv_dtype):
    """A step writing into quantized pools, fresh rows (flash on the Pallas backends: fed the new
    K/V as the pools hold them) and cached ones, against the written pools dequantized."""
    for seqs in (FRESH, CACHED):
        out, case = attend_case(seqs, backend, kv_dtype=kv_dtype)
        assert_close(out, case)


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])
def test_attend_through_lane_padded_pools_matches_oracle(backend):
    """Pools padded to 128 lanes (TPU) give the unpadded attention, for fresh and cached rows."""
    for seqs in (FRESH, CACHED):
        out, case = attend_case(seqs, backend, pool_head_dim=128)
        assert out.shape[-1] == 64
        assert_close(out, case)


@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_flash_runs_only_for_leading_fresh_prefill_rows(monkeypatch, backend):
    # A flash kernel that returns zeros: the leading fresh rows' tokens must show it, no other.
    flash = importlib.import_module(f"pallas_kernels.flash_attention.{backend.removeprefix('pallas_')}")
    monkeypatch.setattr(flash, "flash_attention", lambda q, *a, **k: jnp.zeros_like(q))
    for seqs, flashed_rows in ((FRESH, 2), (CACHED, 1), (MIXED, 1)):
        out, case = attend_case(seqs, backend)
        end, want = int(case["query_start_loc"][flashed_rows]), oracle(case)
        assert not np.asarray(out[:end]).any()
        assert np.abs(want[:end]).max() > 0.1
        assert np.abs(np.asarray(out[end:]) - want[end:]).max() < TOL["float32"]


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


def slot_scales(scale_pool, page_size):
    """[N, KVH, 1, lanes] scales -> float64 [N, KVH, page_size]."""
    return np.asarray(scale_pool, np.float64)[:, :, 0, :page_size]


@pytest.mark.parametrize("backend", ["xla", "pallas_tpu"])   # the GPU kernel's: test_gpu_kernels.py
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: "g{}-kvh{}-d{}-ps{}-{}-w{}".format(*c))
def test_paged_paths_read_quantized_pools_through_their_scales(kv_dtype, config, backend):
    """Int8 / fp8 pools with per-slot scales give the attention of the dequantized pools (naive
    oracle), and NaN scales in pages no row may read (a freed page) change nothing."""
    group, kvh, head_dim, page_size, dtype, window = config
    case = make_case(5, seqs=mixed_batch(page_size), num_kv_heads=kvh, group=group, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, pad_tokens=3, sliding_window=window)
    storage = kv_cache.KV_CACHE_DTYPES[kv_dtype]
    lanes = kv_cache.scale_lanes(page_size, "tpu")   # as TPU pools hold them (both paths run on TPUs)
    (k, k_scale, k_deq), (v, v_scale, v_deq) = (quantized(case[name], storage, lanes) for name in ("k_pages", "v_pages"))
    lens, table = np.asarray(case["seq_lens"]), np.asarray(case["page_table"])
    read = {int(table[s, p]) for s in range(len(lens)) for p in range(-(-int(lens[s]) // page_size))}
    unread = np.array(sorted(set(range(k.shape[0])) - read))
    k_scale, v_scale = (x.at[unread].set(np.nan) for x in (k_scale, v_scale))
    meta = attention.AttentionMetadata(
        positions=None, slot_mapping=None, page_table=case["page_table"], seq_lens=case["seq_lens"],
        query_start_loc=case["query_start_loc"], max_q=case["max_q"], backend=backend)
    out = attention.paged_attention(case["q"], kv_cache.LayerKV(k, v, k_scale, v_scale), meta,
                                    sliding_window=window, sm_scale=case["sm_scale"])
    assert_close(out, dict(case, k_pages=k_deq, v_pages=v_deq))
    # and the quantization itself is as fine as the dtype allows: int8 half a step of the scale;
    # e4m3 half a unit in the last of 3 mantissa bits, or half its subnormal step (2^-9 x scale)
    pages, step = np.asarray(case["k_pages"], np.float64), slot_scales(k_scale, page_size)[..., None]
    bound = step / 2 if kv_dtype == "int8" else np.abs(pages) * 2.0 ** -4 + step * 2.0 ** -10
    used = np.array(sorted(read))
    assert np.all(np.abs(k_deq - pages)[used] <= bound[used] * (1 + 1e-6) + 1e-7)
