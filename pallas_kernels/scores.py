"""What every attention path does to raw scaled scores before masking: Gemma 2's soft cap, then
ALiBi (BLOOM, MPT); and attention sinks (gpt-oss) in the softmax.

ALiBi adds slope[head] * (key position - query position). The query term is constant along a
softmax row, and softmax ignores a constant added to a row, so only slope * key position is
added: no query position and no [q, k] bias matrix. The same holds for any offset common to a
row's keys, which lets a kernel use positions relative to anything fixed per row (the flash
kernel's packed index, a sequence's first cached token).

Sinks: each query head has a learned logit sinks[head] that joins every row's softmax as one more
column and is then dropped: it takes weight from the keys and gives the output nothing. A row
with no visible key gives 0. In an online softmax it is one term after the last KV block
(`add_sink`); kernels that split the KV and merge partial results add it once, at the merge.

ALiBi with sinks: the sink column has no key, so the row's constant does not cancel against it.
Scores that lack -slope * query position are compared with the sink logit raised by
slope * query position instead (`sink_logits`), the query position in the same frame as the
keys' (any offset common to the row's keys and its query cancels again). Without it the sink's
weight shrinks with the query's distance from position 0 (errors of order 1 in the output).
"""
import jax
import jax.numpy as jnp


def modify_scores(scores, kv_pos, *, soft_cap=None, slopes=None):
    """scores f32; kv_pos int, broadcastable to scores; slopes f32 broadcastable to scores (each
    row's head's slope), or None. soft_cap: scores become soft_cap * tanh(scores / soft_cap)."""
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    if slopes is not None:
        scores = scores + slopes * kv_pos.astype(jnp.float32)
    return scores


def softmax(scores, sinks=None):
    """Softmax over the last axis of masked f32 scores, with each row's sink logit (sinks
    broadcastable to scores[..., :1]) as an extra column that is dropped; None: plain softmax."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    m = jnp.maximum(scores.max(axis=-1, keepdims=True), sinks)
    p = jnp.exp(scores - m)
    return p / (p.sum(axis=-1, keepdims=True) + jnp.exp(sinks - m))


def sink_logits(sinks, slopes=None, q_pos=None):
    """Each row's sink logit beside scores from `modify_scores`: sinks, plus slopes * q_pos with
    ALiBi (slopes None: sinks as they are). sinks, slopes f32 and q_pos int, broadcastable to
    each other: the row's head's sink and slope, the row's query position in its keys' frame."""
    if slopes is None:
        return sinks
    return sinks + slopes * q_pos.astype(jnp.float32)


def add_sink(m, l, sinks):
    """An online softmax's running max m and sum l after its last block, with one more logit per
    row, `sinks` (broadcastable to m): (the final sum, the factor the output accumulator is scaled
    by). A row with no visible key kept m at the mask value: its factor is 0, its output 0."""
    m_new = jnp.maximum(m, sinks)
    alpha = jnp.exp(m - m_new)
    return l * alpha + jnp.exp(sinks - m_new), alpha
