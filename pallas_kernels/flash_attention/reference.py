"""Plain jnp reference of masked (causal / sliding-window / segment) attention."""
import jax.numpy as jnp

from pallas_kernels.scores import modify_scores, sink_logits, softmax

MASK_VALUE = -1e30  # finite so fully-masked (padding) rows stay NaN-free


def causal_attention(q, k, v, *, sliding_window=None, sm_scale, segment_ids=None, soft_cap=None,
                     alibi_slopes=None, sinks=None, causal=True):
    """Dense attention. q [B, T, H, D]; k, v [B, T, KVH, D]; segment_ids [B, T] (optional).

    soft_cap: logits become soft_cap * tanh(logits / soft_cap) (Gemma 2) before masking.
    alibi_slopes: f32 [H] or None; adds slope * key position (pallas_kernels/scores.py).
    sinks: f32 [H] or None; each head's sink logit joins the softmax (pallas_kernels/scores.py).
    causal=False attends in both directions (still within a segment)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, d)
    s = jnp.einsum("bqkgd,bjkd->bkgqj", qg, k, preferred_element_type=jnp.float32) * sm_scale
    pos = jnp.arange(t)

    def per_head(x):  # f32[H] or None -> each score row's value, [KVH, group, 1, 1]
        return None if x is None else x.astype(jnp.float32).reshape(kvh, h // kvh)[:, :, None, None]

    s = modify_scores(s, pos, soft_cap=soft_cap, slopes=per_head(alibi_slopes))
    mask = jnp.ones((t, t), bool)
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        mask &= pos[None, :] > pos[:, None] - sliding_window
    mask = mask[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    s = jnp.where(mask[:, None, None], s, MASK_VALUE)
    if sinks is not None:   # with ALiBi, each row's sink raised by slope * its (packed) position
        sinks = sink_logits(per_head(sinks), per_head(alibi_slopes), pos[:, None])
    p = softmax(s, sinks)
    o = jnp.einsum("bkgqj,bjkd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, t, h, d).astype(q.dtype)
