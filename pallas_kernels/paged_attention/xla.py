"""Ragged paged attention in plain XLA, blockwise: the engine's path where no Pallas kernel runs
(CPU), and its fallback anywhere.

Rows are padded to [S, max_q] queries (as in reference.py), but K/V are read in blocks of pages
inside a while loop whose trip count is the longest live row's KV length, with online softmax.
So the cost follows the real context lengths of the step, not the page table's width: the
runner can pass full-width page tables (no page-count buckets to compile) and a padded row or
an empty group costs nearly nothing. Under a sliding window the loop starts at the first block
any row can see.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.scores import add_sink, modify_scores, sink_logits

MASK_VALUE = -1e30


@functools.partial(jax.jit, static_argnames=("max_q", "sm_scale", "sliding_window", "soft_cap", "block_tokens"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *, max_q,
                           sm_scale, sliding_window=None, soft_cap=None, alibi_slopes=None, sinks=None,
                           k_scale=None, v_scale=None, block_tokens=128):
    """q [T, H, D] flat ragged batch; sequence s owns tokens query_start_loc[s]:[s+1], the last
    of its seq_lens[s] positions. Tokens outside query_start_loc[0]:[-1] come back as 0.
    soft_cap: scores become soft_cap * tanh(scores / soft_cap) (Gemma 2), before the mask.
    alibi_slopes: f32 [H] or None: ALiBi, slope * key position added (pallas_kernels/scores.py).
    sinks: f32 [H] or None: each head's sink logit joins the softmax (pallas_kernels/scores.py).
    k_scale, v_scale: f32 [num_pages, KVH, 1, lanes >= page_size] or None: quantized pools (int8,
    fp8) hold K / scale and V / scale per (slot, KV head), slot s's scale in lane s (layout:
    jaxserve/kv_cache.py); the scales multiply the scores and the attention weights, so no
    dequantized K or V is formed. v_pages None: the values are the keys (latent attention), read
    from k_pages once (with k_scale).
    Pages are gathered whole from the pool as it is: no 2-D view of it, which on TPU (tiled
    dimensions merged) or under KV-head sharding (sharded axis merged) would cost a copy or an
    all-gather of the whole pool per read, and on CPU measured no faster in this layout."""
    t, h, d = q.shape
    s_max, p = page_table.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    if v_pages is None:
        v_scale = k_scale
    bp = max(1, min(p, block_tokens // ps))  # pages per block
    bt = bp * ps
    page_table = jnp.pad(page_table, ((0, 0), (0, -p % bp)))

    tok = jnp.arange(t)
    seq_id = jnp.clip(jnp.searchsorted(query_start_loc[1:], tok, side="right", method="compare_all"), 0, s_max - 1)
    q_off = tok - query_start_loc[seq_id]
    valid = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    row = jnp.where(valid, seq_id, s_max)  # other tokens scatter out of range and are dropped
    qp = jnp.zeros((s_max, max_q, h, d), q.dtype).at[row, q_off].set(q, mode="drop")
    # One [query x group] row axis per KV head: plain batched matmuls (s, kv head), which XLA
    # CPU runs about 2x faster than a dot that keeps the group as its own axis.
    rows = max_q * g
    qp = qp.reshape(s_max, max_q, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(s_max, kvh, rows, d)

    q_len = query_start_loc[1:] - query_start_loc[:-1]
    first_pos = seq_lens - q_len
    q_pos = jnp.repeat(first_pos[:, None] + jnp.arange(max_q)[None, :], g, axis=1)  # [S, rows]
    live = q_len > 0

    def per_row(x):  # f32[H] or None -> each row's (query, head in group) of each KV head: [KVH, rows]
        return None if x is None else jnp.tile(x.astype(jnp.float32).reshape(kvh, g), (1, max_q))

    slopes = None if alibi_slopes is None else per_row(alibi_slopes)[:, :, None]
    end_block = (jnp.max(jnp.where(live, seq_lens, 0)) + bt - 1) // bt
    start_block = 0
    if sliding_window is not None:
        lowest = jnp.min(jnp.where(live, first_pos - sliding_window + 1, jnp.iinfo(jnp.int32).max))
        start_block = jnp.minimum(jnp.maximum(lowest, 0) // bt, end_block)

    def gather(pool, pages):
        """[S, bp] pages -> their K or V as [S, KVH, bt, D]."""
        return pool[pages].transpose(0, 2, 1, 3, 4).reshape(s_max, kvh, bt, pool.shape[-1])

    def gather_scales(pool, pages):
        """[S, bp] pages -> their scales as [S, KVH, bt] (cut to page_size lanes after the gather:
        before it, the cut would be a copy of the whole pool)."""
        return pool[pages][:, :, :, 0, :ps].transpose(0, 2, 1, 3).reshape(s_max, kvh, bt)

    def block(j, carry):
        m, l, acc = carry
        pages = lax.dynamic_slice_in_dim(page_table, j * bp, bp, axis=1)  # [S, bp]
        k = gather(k_pages, pages).astype(q.dtype)
        v = k if v_pages is None else gather(v_pages, pages).astype(q.dtype)
        s = jnp.einsum("skrd,skjd->skrj", qp, k, preferred_element_type=jnp.float32) * sm_scale
        if k_scale is not None:
            s = s * gather_scales(k_scale, pages)[:, :, None, :]
        kv_pos = j * bt + jnp.arange(bt)
        s = modify_scores(s, kv_pos, soft_cap=soft_cap, slopes=slopes)
        # Slots past a row's length hold another request's K/V or nothing (a free page, a page
        # table's padding): a zero weight does not cancel an inf or NaN there, a zeroed V does.
        in_seq = (kv_pos[None, :] < seq_lens[:, None])[:, None, :]   # [S, 1, bt]
        v = jnp.where(in_seq[..., None], v, 0)
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]
        if sliding_window is not None:
            mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
        mask = mask[:, None]  # [S, 1, rows, bt]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, MASK_VALUE), axis=-1))
        probs = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        l = l * scale + probs.sum(-1)
        weights = probs if v_scale is None else probs * jnp.where(in_seq, gather_scales(v_scale, pages), 0)[:, :, None, :]
        acc = acc * scale[..., None] + jnp.einsum("skrj,skjd->skrd", weights.astype(v.dtype), v,
                                                  preferred_element_type=jnp.float32)
        return m_new, l, acc

    stats = jnp.full((s_max, kvh, rows), MASK_VALUE, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros((s_max, kvh, rows, d), jnp.float32))
    m, l, acc = lax.fori_loop(start_block, end_block, block, init)
    if sinks is not None:
        slope_rows = None if alibi_slopes is None else per_row(alibi_slopes)
        l, alpha = add_sink(m, l, sink_logits(per_row(sinks), slope_rows, q_pos[:, None, :]))   # [S, KVH, rows]
        acc = acc * alpha[..., None]
    o = acc / jnp.maximum(l, 1e-30)[..., None]
    o = o.reshape(s_max, kvh, max_q, g, d).transpose(0, 2, 1, 3, 4).reshape(s_max, max_q, h, d)
    return jnp.where(valid[:, None, None], o[seq_id, q_off], 0).astype(q.dtype)
