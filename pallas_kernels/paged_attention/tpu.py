"""Ragged paged attention for TPU (Pallas, Mosaic TPU).

Grid (kv_head, q_block). A q block is `block_q` consecutive tokens of the flat ragged batch, any
mix of prefill chunks and decodes. The wrapper lays q out so that program (h, i) gets one 2-D
block of rows = (query head of KV head h's group, token): the group shares every K/V page it
reads (GQA), and the kernel needs no in-kernel reshape.

Inside a program the work is a list of (sequence, KV chunk) items: every sequence overlapping
the block, and for each the chunks of `pages_per_chunk` pages its rows can see (causal bound
above, sliding window below, so pages wholly outside the window are never read). Pages are
copied HBM -> VMEM by hand with async DMAs through the scalar-prefetched page table, two chunk
buffers deep: the next item's copy is in flight while the current one is computed. One DMA per
(page, KV head) moves a contiguous [page_size, head_dim] slab: page_size a multiple of the
sublane tile (8 rows f32, 16 bf16), so the chunk buffer is filled in whole tiles. Softmax is
online, in f32 VMEM scratch; rows of other sequences are masked. Without V pages (the values are
the keys: latent attention) a chunk's K buffer serves as its V, one DMA per page.

m and l are kept lane-replicated ([rows, 128]) and chunks are a multiple of 128 keys, the layout
Mosaic handles without relayouts. ALiBi slopes and sink logits arrive the same way, one
lane-replicated row per (head, token) row of the q block; soft cap, ALiBi and sinks (one term
after the last chunk) go through pallas_kernels/scores.py.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.scores import add_sink, modify_scores, sink_logits

MASK_VALUE = -1e30
LANES = 128
MIN_BLOCK_TOKENS = 8


def _lanes(x, n):
    """[rows, 128] lane-replicated -> [rows, n]."""
    if n % LANES == 0:
        return jnp.tile(x, (1, n // LANES))
    return x[:, :n]


def _kernel(page_table_ref, seq_lens_ref, qsl_ref, blk_first_ref, blk_end_ref,  # SMEM
            q_ref, *refs,  # q block [g * block_q, D]; K (and V) pages [N, KVH, ps, D] in HBM,
            # [ALiBi slopes], [sinks] ([g * block_q, 128] each), [K (and V) scales in HBM], out, scratch
            block_q, pages_per_chunk, pages_per_seq, sm_scale, sliding_window, soft_cap, alibi, sinks, quantized,
            pools):
    # pools: 2 (K and V pages), or 1 (K alone: the values are the keys).
    pages_hbm, refs = refs[:pools], refs[pools:]
    slope_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    scales_hbm, refs = (refs[:pools], refs[pools:]) if quantized else ((), refs)   # [N, KVH, 1, lanes] each
    o_ref, refs = refs[0], refs[1:]
    scale_bufs, refs = (refs[:pools], refs[pools:]) if quantized else ((), refs)   # [2, pages, 1, lanes] each
    page_bufs, (sems, m_ref, l_ref, acc_ref) = refs[:pools], refs[pools:]
    k_hbm, k_buf = pages_hbm[0], page_bufs[0]
    ks_buf, vs_buf = (scale_bufs[0], scale_bufs[-1]) if quantized else (None, None)
    h, i = pl.program_id(0), pl.program_id(1)
    page_size = k_hbm.shape[2]
    chunk = k_buf.shape[1]
    tok0 = i * block_q
    s_end = blk_end_ref[i]

    def span(s):
        """(position offset, first page, end page, number of chunks) of sequence s in this block."""
        s = jnp.minimum(s, seq_lens_ref.shape[0] - 1)  # s may be one past the end: keep reads in range
        q_start, q_end = qsl_ref[s], qsl_ref[s + 1]
        offset = seq_lens_ref[s] - q_end  # token t sits at position t + offset
        first = jnp.maximum(q_start, tok0)
        last = jnp.minimum(q_end, tok0 + block_q) - 1
        page_end = lax.div(last + offset, page_size) + 1
        page_lo = 0
        if sliding_window is not None:
            page_lo = lax.div(jnp.maximum(first + offset - sliding_window + 1, 0), page_size)
        num_chunks = lax.div(page_end - page_lo + pages_per_chunk - 1, pages_per_chunk)
        return offset, page_lo, page_end, jnp.where(last >= first, num_chunks, 0)

    def copy_chunk(s, c, slot, action):
        """Start (or wait for) the DMAs of chunk c of sequence s into buffer `slot`; pages past
        the sequence's end are skipped."""
        _, page_lo, page_end, _ = span(s)

        def page_copy(j, _):
            page = page_lo + c * pages_per_chunk + j
            phys = page_table_ref[s * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)]
            rows_j = pl.ds(pl.multiple_of(j * page_size, page_size), page_size)
            # Page phys of KV head h: one contiguous [page_size, D] slab, whole tiles; its scales
            # of KV head h: [1, lanes], one row of whole (1, 128) tiles.
            copies = [(src.at[phys, h], dst.at[slot, rows_j]) for src, dst in zip(pages_hbm, page_bufs)]
            copies += [(src.at[phys, h], dst.at[slot, j]) for src, dst in zip(scales_hbm, scale_bufs)]
            for kind, (src, dst) in enumerate(copies):
                dma = pltpu.make_async_copy(src, dst, sems.at[kind, slot])
                pl.when(page < page_end)(getattr(dma, action))

        lax.fori_loop(0, pages_per_chunk, page_copy, None)

    def advance(s, c):
        """The item after (s, c): the next chunk, else chunk 0 of the next sequence with work."""
        return lax.while_loop(lambda sc: (sc[0] < s_end) & (sc[1] >= span(sc[0])[3]),
                              lambda sc: (sc[0] + 1, jnp.int32(0)), (s, c + 1))

    def compute(s, c, slot):
        offset, page_lo, page_end, _ = span(s)
        kv0 = (page_lo + c * pages_per_chunk) * page_size
        k = k_buf[slot].astype(q_ref.dtype)
        v = page_bufs[-1][slot].astype(q_ref.dtype) if pools == 2 else k
        # Buffer rows past the sequence's last page, and its last page's slots past its length,
        # hold stale (maybe inf or NaN) data, which a zero weight does not cancel: zero them in v.
        kv_end = jnp.minimum(page_end * page_size, seq_lens_ref[s])
        kv_row = kv0 + lax.broadcasted_iota(jnp.int32, v.shape, 0)
        v = jnp.where(kv_row < kv_end, v, jnp.zeros_like(v))
        scores = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * sm_scale
        if quantized:
            k_scales = _scale_row(ks_buf, slot, page_size, kv0, kv_end, chunk)
            scores *= k_scales
        tok = tok0 + (lax.broadcasted_iota(jnp.int32, scores.shape, 0) & (block_q - 1))
        q_pos = tok + offset
        kv_pos = kv0 + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        scores = modify_scores(scores, kv_pos, soft_cap=soft_cap,
                               slopes=None if slope_ref is None else _lanes(slope_ref[...], chunk))
        mask = (tok >= qsl_ref[s]) & (tok < qsl_ref[s + 1]) & (kv_pos <= q_pos)
        if sliding_window is not None:
            mask &= kv_pos > q_pos - sliding_window
        scores = jnp.where(mask, scores, MASK_VALUE)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(scores - _lanes(m_next, chunk)), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        weights = p
        if quantized:
            weights *= _scale_row(vs_buf, slot, page_size, kv0, kv_end, chunk) if pools == 2 else k_scales
        pv = jnp.dot(weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * _lanes(alpha, acc_ref.shape[1]) + pv

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    s0, c0 = advance(blk_first_ref[i], jnp.int32(-1))
    pl.when(s0 < s_end)(lambda: copy_chunk(s0, c0, 0, "start"))

    def step(carry):
        s, c, slot = carry
        s_next, c_next = advance(s, c)
        pl.when(s_next < s_end)(lambda: copy_chunk(s_next, c_next, 1 - slot, "start"))
        copy_chunk(s, c, slot, "wait")
        compute(s, c, slot)
        return s_next, c_next, 1 - slot

    lax.while_loop(lambda carry: carry[0] < s_end, step, (s0, c0, jnp.int32(0)))

    l, alpha = l_ref[...], 1.0
    if sinks:   # the output is acc * alpha / l
        sink, slopes, q_pos = sink_ref[...], None, None
        if alibi:   # each row's sink raised by slope * its token's position (scores.py)
            tok = tok0 + (lax.broadcasted_iota(jnp.int32, sink.shape, 0) & (block_q - 1))

            def position(s, pos):   # rows of sequence s: token t sits at position t + offset
                rows_s = (tok >= qsl_ref[s]) & (tok < qsl_ref[s + 1])
                return jnp.where(rows_s, tok + seq_lens_ref[s] - qsl_ref[s + 1], pos)

            slopes, q_pos = slope_ref[...], lax.fori_loop(blk_first_ref[i], s_end, position, jnp.zeros_like(tok))
        l, alpha = add_sink(m_ref[...], l, sink_logits(sink, slopes, q_pos))
    inv = jnp.where(l > 0, alpha / jnp.where(l > 0, l, 1.0), 0.0)  # rows with no keys (padding) -> 0
    o_ref[...] = (acc_ref[...] * _lanes(inv, acc_ref.shape[1])).astype(o_ref.dtype)


def _scale_row(buf, slot, page_size, kv0, kv_end, chunk):
    """The scales of the chunk in buffer `slot` ([pages, 1, lanes], this program's KV head) as one
    [1, chunk] row of keys along lanes, 0 past kv_end. A page's page_size scales land at lane
    offset j * page_size, which no DMA or lane slice can do for a page under 128 slots: each
    page's row is spread over the chunk's lanes by a matmul with a 0/1 placement matrix (exact
    at HIGHEST precision). Stale slots and the lanes past page_size (maybe NaN) are zeroed
    before it, since the matmul would spread a NaN over every lane."""
    num_pages, _, lanes = buf.shape[1:]
    place_shape = (lanes, chunk)
    src = lax.broadcasted_iota(jnp.int32, place_shape, 0)
    dst = lax.broadcasted_iota(jnp.int32, place_shape, 1)
    lane = lax.broadcasted_iota(jnp.int32, (1, lanes), 1)
    row = jnp.zeros((1, chunk), jnp.float32)
    for j in range(num_pages):
        slab = jnp.where((lane < page_size) & (kv0 + j * page_size + lane < kv_end), buf[slot, j], 0.0)
        place = (dst == j * page_size + src).astype(jnp.float32)
        row += jnp.dot(slab, place, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return row


def _pow2_at_most(n):
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_at_least(n):
    return 1 << max(n - 1, 0).bit_length()


@functools.partial(jax.jit, static_argnames=(
    "max_q", "sm_scale", "sliding_window", "soft_cap", "block_rows", "kv_block", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *,
                           max_q, sm_scale, sliding_window=None, soft_cap=None, alibi_slopes=None, sinks=None,
                           k_scale=None, v_scale=None, block_rows=256, kv_block=256, interpret=False):
    """q [T, H, D]; k/v pages [N, KVH, page_size, D]; page_table int32[S, P]; seq_lens int32[S];
    query_start_loc int32[S + 1]; max_q: static bound on any sequence's q_len. v_pages None (and
    v_scale None): the values are the keys, read from the K pages' buffers. Returns [T, H, D],
    0 for tokens outside [query_start_loc[0], query_start_loc[-1]). soft_cap, alibi_slopes and
    sinks (f32[H] or None): pallas_kernels/scores.py. k_scale, v_scale: f32 [N, KVH, 1, lanes] or
    None: quantized pools (int8, fp8; jaxserve/kv_cache.py), read as they are; the scales multiply
    the scores and the attention weights, as on the XLA path. lanes: page_size or more, whole 128s
    on a TPU (in other lanes XLA would copy the whole scale pool into tiles before every call).

    block_rows: most (head, token) rows per program. block_q, the tokens per q block, is max_q
    rounded up to a power of two within that cap, and at least MIN_BLOCK_TOKENS and one tile of
    rows. Every sequence of a block is computed over all the block's rows, so in a decode batch
    (one token per sequence) a block of block_q tokens does block_q times the useful MXU work:
    decode blocks are kept small, but not below MIN_BLOCK_TOKENS, since each program waits for
    its first pages unhidden and that wait is shared by the block's sequences. Prefill gets large
    blocks, since each q block re-reads its sequences' pages. kv_block: keys per chunk, a
    multiple of 128; a page larger than kv_block makes a chunk of one page. interpret: run in
    TPU interpret mode (CPU tests)."""
    t, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    if not interpret and page_size % (32 // k_pages.dtype.itemsize):  # the interpreter has no tiles
        raise ValueError(f"page_size {page_size} is not a multiple of the {k_pages.dtype} sublane tile "
                         f"({32 // k_pages.dtype.itemsize} rows): its page DMAs would split tiles")
    if not interpret and k_scale is not None and k_scale.shape[-1] % LANES:
        raise ValueError(f"scale pools of {k_scale.shape[-1]} lanes: XLA would copy them whole before every "
                         f"call; store them in whole 128 lanes (jaxserve/kv_cache.py scale_lanes)")
    pages_per_chunk = max(1, kv_block // page_size)
    if (pages_per_chunk * page_size) % LANES:
        raise ValueError(f"kv_block {kv_block} and page_size {page_size}: a chunk of "
                         f"{pages_per_chunk} pages is not a multiple of 128 keys")
    tile_rows = 32 // q.dtype.itemsize  # rows of a full (8, 128) f32 / (16, 128) bf16 tile
    block_q = max(_pow2_at_least(-(-tile_rows // group)),
                  min(_pow2_at_least(max(max_q, MIN_BLOCK_TOKENS)), _pow2_at_most(block_rows // group)))
    num_blocks = pl.cdiv(t, block_q)
    rows = group * block_q

    # [T, H, D] -> [KVH, q_block, (head in group, token), D]
    qb = jnp.pad(q, ((0, num_blocks * block_q - t), (0, 0), (0, 0)))
    qb = qb.reshape(num_blocks, block_q, num_kv_heads, group, head_dim)
    qb = qb.transpose(2, 0, 3, 1, 4).reshape(num_kv_heads, num_blocks, rows, head_dim)

    # Sequences overlapping each q block: [first, end).
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    search = functools.partial(jnp.searchsorted, method="compare_all")   # one fusion, no loop
    blk_first = search(query_start_loc[1:], starts, side="right").astype(jnp.int32)
    blk_end = search(query_start_loc[:-1], starts + block_q, side="left").astype(jnp.int32)

    block = pl.BlockSpec((None, None, rows, head_dim), lambda h, i, *_: (h, i, 0, 0))
    pools = [k_pages] if v_pages is None else [k_pages, v_pages]
    in_specs = [block] + [pl.BlockSpec(memory_space=pl.ANY)] * len(pools)
    inputs = [qb, *pools]
    for per_head in (alibi_slopes, sinks):   # row (head in group, token) of KV head h: its head's value
        if per_head is not None:
            per_row = jnp.repeat(per_head.astype(jnp.float32).reshape(num_kv_heads, group), block_q, axis=1)
            inputs.append(jnp.broadcast_to(per_row[:, :, None], (num_kv_heads, rows, LANES)))
            in_specs.append(pl.BlockSpec((None, rows, LANES), lambda h, i, *_: (h, 0, 0)))
    quantized = k_scale is not None
    scale_bufs = []
    if quantized:
        inputs += [x.astype(jnp.float32) for x in (k_scale, v_scale)[:len(pools)]]
        in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * len(pools)
        scale_bufs = [pltpu.VMEM((2, pages_per_chunk, 1, k_scale.shape[-1]), jnp.float32)] * len(pools)
    kernel = functools.partial(
        _kernel, block_q=block_q, pages_per_chunk=pages_per_chunk, pages_per_seq=pages_per_seq,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, alibi=alibi_slopes is not None,
        sinks=sinks is not None, quantized=quantized, pools=len(pools))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_kv_heads, num_blocks),
            in_specs=in_specs,
            out_specs=block,
            scratch_shapes=scale_bufs + [pltpu.VMEM((2, pages_per_chunk * page_size, head_dim), x.dtype)
                                         for x in pools] + [
                pltpu.SemaphoreType.DMA((len(pools) * (1 + quantized), 2)),
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, LANES), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ]),
        out_shape=jax.ShapeDtypeStruct(qb.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="ragged_paged_attention",
    )(page_table.reshape(-1), seq_lens, query_start_loc, blk_first, blk_end, *inputs)

    out = out.reshape(num_kv_heads, num_blocks, group, block_q, head_dim)
    return out.transpose(1, 3, 0, 2, 4).reshape(num_blocks * block_q, num_heads, head_dim)[:t]
