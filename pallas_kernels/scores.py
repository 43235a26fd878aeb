"""What every attention path does to raw scaled scores before masking: Gemma 2's soft cap, then
ALiBi (BLOOM, MPT).

ALiBi adds slope[head] * (key position - query position). The query term is constant along a
softmax row, and softmax ignores a constant added to a row, so only slope * key position is
added: no query position and no [q, k] bias matrix. The same holds for any offset common to a
row's keys, which lets a kernel use positions relative to anything fixed per row (the flash
kernel's packed index, a sequence's first cached token).
"""
import jax.numpy as jnp


def modify_scores(scores, kv_pos, *, soft_cap=None, slopes=None):
    """scores f32; kv_pos int, broadcastable to scores; slopes f32 broadcastable to scores (each
    row's head's slope), or None. soft_cap: scores become soft_cap * tanh(scores / soft_cap)."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if slopes is not None:
        scores = scores + slopes * kv_pos.astype(jnp.float32)
    return scores
