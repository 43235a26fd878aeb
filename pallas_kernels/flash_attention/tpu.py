"""Block-sparse flash attention for TPU (Pallas / Mosaic TPU).

Grid (batch, q head, q block, kv slot); the kv slot axis is sequential ("arbitrary") and walks the
q block's visit list from `masks.block_schedule`, which is scalar-prefetched into SMEM and read by
the K/V index maps. Slots past the list's end repeat its last block, so the pipeline issues no DMA
for them and the body is skipped. Running max / sum / output accumulate in f32 VMEM scratch.
GQA: q head h reads kv head h // group through the index map; K/V are never repeated.

Layout: Mosaic wants the last two block dims to be the full dims or multiples of (8, 128), so the
wrapper moves heads in front of time ([B, H, T, D]); segment ids travel as [B, T, 1] (q rows)
and [B, 1, T] (kv columns) so that both tiles broadcast to [block_q, block_kv]. The running max
and sum are kept lane-replicated ([block_q, 128]), the layout Mosaic reduces into without relayouts.
ALiBi slopes and sink logits (one per q head) sit whole in SMEM; soft cap, ALiBi and sinks (one
term after the last kv block): pallas_kernels/scores.py.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.flash_attention.masks import MASK_VALUE, Mask, block_schedule, pad_to_blocks
from pallas_kernels.scores import add_sink, modify_scores, sink_logits

LANES = 128


def _lanes(x, n):
    """[rows, 128] lane-replicated -> [rows, n]."""
    return x[:, :n] if n <= LANES else jnp.tile(x, (1, pl.cdiv(n, LANES)))[:, :n]


def _kernel(kv_block_ref, full_ref, count_ref, q_ref, k_ref, v_ref, q_seg_ref, kv_seg_ref, *refs,
            mask, sm_scale, soft_cap, alibi, sinks, block_q, block_kv, nq, nk):
    refs = list(refs)
    slope_ref = refs.pop(0) if alibi else None
    sink_ref = refs.pop(0) if sinks else None
    o_ref, m_ref, l_ref, acc_ref = refs
    b, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    row = b * nq + i
    slot = row * nk + j

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def visit(masked):
        s = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale
        shape = (block_q, block_kv)
        kv_pos = kv_block_ref[slot] * block_kv + lax.broadcasted_iota(jnp.int32, shape, 1)
        s = modify_scores(s, kv_pos, soft_cap=soft_cap, slopes=None if slope_ref is None else slope_ref[h])
        if masked:
            q_pos = i * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
            s = jnp.where(mask.visible(q_pos, kv_pos, q_seg_ref[...], kv_seg_ref[...]), s, MASK_VALUE)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - _lanes(m_new, block_kv))
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
        acc_ref[...] = _lanes(alpha, pv.shape[1]) * acc_ref[...] + pv
        m_ref[...] = m_new

    full = full_ref[row]   # the FULL tiles come first (masks.block_schedule)
    pl.when(j < full)(lambda: visit(masked=False))
    pl.when((j >= full) & (j < count_ref[row]))(lambda: visit(masked=True))

    @pl.when(j == nk - 1)
    def _finish():
        acc, l = acc_ref[...], l_ref[...]
        if sinks:
            q_pos = i * block_q + lax.broadcasted_iota(jnp.int32, l.shape, 0)   # ALiBi: scores.py
            sink = sink_logits(sink_ref[h], None if slope_ref is None else slope_ref[h], q_pos)
            l, alpha = add_sink(m_ref[...], l, sink)
            acc = acc * _lanes(alpha, acc.shape[1])
        o_ref[...] = (acc / _lanes(l, acc.shape[1])).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=(
    "causal", "sliding_window", "soft_cap", "sm_scale", "block_q", "block_kv", "interpret"))
def flash_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None, soft_cap=None,
                    alibi_slopes=None, sinks=None, sm_scale=None, block_q=128, block_kv=128, interpret=False):
    """q [B, T, H, D]; k, v [B, T, KVH, D] (H a multiple of KVH); segment_ids int [B, T] or None;
    alibi_slopes, sinks f32[H] or None. Returns [B, T, H, D] like q. interpret=True runs the kernel
    in TPU interpret mode (CPU)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    mask = Mask(causal, sliding_window)
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    q, k, v, seg = pad_to_blocks(q, k, v, segment_ids, block_q, block_kv)
    tp = q.shape[1]
    nq, nk = tp // block_q, tp // block_kv
    sched = block_schedule(mask, seg, block_q, block_kv)
    group = h // kvh

    def kv_index(b, h, i, j, kv_block, full, count):
        # lax.div, not //: Mosaic lowers floor division through `sign`, which needs a real TPU
        return b, lax.div(h, group), kv_block[(b * nq + i) * nk + j], 0

    def kv_seg_index(b, h, i, j, kv_block, full, count):
        return b, 0, kv_block[(b * nq + i) * nk + j]

    q_index = lambda b, h, i, j, *_: (b, h, i, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((None, None, block_q, d), q_index),
        pl.BlockSpec((None, None, block_kv, d), kv_index),
        pl.BlockSpec((None, None, block_kv, d), kv_index),
        pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, *_: (b, i, 0)),
        pl.BlockSpec((None, 1, block_kv), kv_seg_index),
    ]
    heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    inputs = [heads_first(q), heads_first(k), heads_first(v), seg[:, :, None], seg[:, None, :]]
    for per_head in (alibi_slopes, sinks):
        if per_head is not None:
            in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
            inputs.append(per_head.astype(jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, h, nq, nk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_q, d), q_index),
        scratch_shapes=[pltpu.VMEM((block_q, LANES), jnp.float32),  # running max
                        pltpu.VMEM((block_q, LANES), jnp.float32),  # running sum
                        pltpu.VMEM((block_q, d), jnp.float32)],     # output accumulator
    )
    kernel = functools.partial(_kernel, mask=mask, sm_scale=sm_scale, soft_cap=soft_cap,
                               alibi=alibi_slopes is not None, sinks=sinks is not None, block_q=block_q,
                               block_kv=block_kv, nq=nq, nk=nk)
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, h, tp, d), q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(sched.kv_block.reshape(-1), sched.full.reshape(-1), sched.count.reshape(-1), *inputs)
    return heads_first(out)[:, :t]
