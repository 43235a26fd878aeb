"""Plain jnp reference of ragged paged attention; also the engine's XLA path on CPU."""
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.scores import modify_scores, sink_logits, softmax

MASK_VALUE = -1e30  # finite so fully-masked (padding) rows stay NaN-free


@functools.partial(jax.jit, static_argnames=("max_q", "sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_xla(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *,
                               max_q, sm_scale, sliding_window=None, soft_cap=None, alibi_slopes=None,
                               sinks=None):
    """XLA path for ragged paged attention: scatter the flat queries into [S, max_q], attend
    densely against each sequence's gathered pages, gather the rows back to [T]. v_pages None:
    the values are the keys."""
    v_pages = k_pages if v_pages is None else v_pages
    t, h, d = q.shape
    s_max, p = page_table.shape
    _, kvh, ps, _ = k_pages.shape
    g = h // kvh
    tok = jnp.arange(t)
    seq_id = jnp.clip(jnp.searchsorted(query_start_loc[1:], tok, side="right"), 0, s_max - 1)
    q_off = tok - query_start_loc[seq_id]
    valid = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])  # this call's tokens only
    row = jnp.where(valid, seq_id, s_max)  # padding tokens scatter out of range and are dropped
    qp = jnp.zeros((s_max, max_q, h, d), q.dtype).at[row, q_off].set(q, mode="drop")
    qp = qp.reshape(s_max, max_q, kvh, g, d)
    k, v = (x[page_table].transpose(0, 1, 3, 2, 4).reshape(s_max, p * ps, kvh, d) for x in (k_pages, v_pages))
    scores = jnp.einsum("sqkgd,sjkd->skgqj", qp, k, preferred_element_type=jnp.float32) * sm_scale
    kv_pos = jnp.arange(p * ps)

    def per_head(x):  # f32[H] or None -> each score row's value, [KVH, group, 1, 1]
        return None if x is None else x.astype(jnp.float32).reshape(kvh, g)[:, :, None, None]

    scores = modify_scores(scores, kv_pos, soft_cap=soft_cap, slopes=per_head(alibi_slopes))
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    q_pos = (seq_lens - q_len)[:, None] + jnp.arange(max_q)[None, :]  # [S, max_q]
    mask = kv_pos[None, None, :] <= q_pos[:, :, None]
    if sliding_window is not None:
        mask &= kv_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    if sinks is not None:   # with ALiBi, each row's sink raised by slope * its position: [S, KVH, g, max_q, 1]
        sinks = sink_logits(per_head(sinks)[None], per_head(alibi_slopes), q_pos[:, None, None, :, None])
    probs = softmax(scores, sinks)
    o = jnp.einsum("skgqj,sjkd->sqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o.reshape(s_max, max_q, h, d)[seq_id, q_off]
    return jnp.where(valid[:, None, None], o, 0).astype(q.dtype)
