"""Block-sparse flash attention for NVIDIA GPUs (Pallas / Mosaic GPU, Hopper and newer).

Backend: Mosaic GPU, not Pallas' Triton lowering. Triton lowering is deprecated from jax 0.11 and
slated for removal; Mosaic GPU is the Pallas GPU backend JAX maintains and targets the machines we
serve on (H100 / H200: TMA copies, wgmma tensor-core instructions). The cost: it needs sm_90+, no
Ampere, no ROCm, and on CPU the kernel runs under Mosaic GPU's own interpreter, race detector on
(pallas_kernels/wgmma.py). Operands must be 16-bit on a GPU: wgmma on f32 (tf32) cannot read the
row-major V tile. f32 runs in interpret mode only.

One CTA (one warpgroup) per (q block, q head, batch). It reads its visit list from
`masks.block_schedule` and loops over exactly `count` kv blocks, double-buffering K/V/segment-id
TMA copies; EMPTY tiles are never copied, FULL tiles skip masking. S = Q @ K^T reads the K tile
transposed in SMEM; P goes through SMEM before P @ V. GQA: q head h reads kv head h // group
straight from K/V, which are never repeated. Soft cap and ALiBi (the CTA's head's slope, one
scalar read): pallas_kernels/scores.py.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import wgmma
from pallas_kernels.flash_attention.masks import (
    FULL, MASK_VALUE, Mask, block_schedule, pad_to_blocks)
from pallas_kernels.scores import modify_scores


def _kernel(q_ref, k_ref, v_ref, seg_ref, kv_block_ref, kind_ref, count_ref, *refs,
            mask, sm_scale, soft_cap, alibi, group, block_q, block_kv, interpret):
    slope_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
    o_ref, q_smem, k_smem, v_smem, p_smem, q_seg_smem, kv_seg_smem, q_bar, k_bar, v_bar = refs
    i, h, b = lax.axis_index("q"), lax.axis_index("heads"), lax.axis_index("batch")
    kvh = h // group
    layout = functools.partial(wgmma.layout_cast, interpret=interpret)
    row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(i * block_q, block_q), h], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(i * block_q, block_q)], q_seg_smem, q_bar)
    count = count_ref[b, i]

    def fetch(j, slot):
        kv = pl.ds(kv_block_ref[b, i, j] * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kv, kvh], k_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(seg_ref.at[b, kv], kv_seg_smem.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem.at[slot], v_bar.at[slot])

    pl.when(count > 0)(lambda: fetch(0, 0))
    plgpu.barrier_wait(q_bar)
    q_seg = layout(q_seg_smem[...], row_layout)
    shape = (block_q, block_kv)
    iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, shape,
                             layout=None if interpret else plgpu.Layout.WGMMA)
    slope = None if slope_ref is None else slope_ref[h]

    def step(j, carry):
        acc, m, l = carry
        slot = lax.rem(j, 2)
        pl.when(j + 1 < count)(lambda: fetch(j + 1, 1 - slot))  # the other slot was freed at j - 1
        plgpu.barrier_wait(k_bar.at[slot])
        s = wgmma.matmul(q_smem, k_smem.at[slot], transpose_b=True, interpret=interpret) * sm_scale

        def kv_positions():
            # From a column vector, built only where used: registers are tight (test_gpu_compile).
            col = plgpu.broadcasted_iota(jnp.int32, (block_kv,), 0, layout=None if interpret else col_layout)
            return lax.broadcast_in_dim(kv_block_ref[b, i, j] * block_kv + col, shape, [1])

        s = modify_scores(s, None if slope is None else kv_positions(), soft_cap=soft_cap, slopes=slope)

        def apply_mask(s):
            q_pos, kv_pos = i * block_q + iota(0), kv_positions()
            kv_seg = layout(kv_seg_smem.at[slot][...], col_layout)
            # Tiles laid out as S is: without the causal comparison against iota (bidirectional
            # masks), jax 0.11's layout inference finds none for the broadcasts (H100, 2026-11-27).
            seg_tiles = [layout(lax.broadcast_in_dim(x, shape, [dim]), plgpu.Layout.WGMMA)
                         for x, dim in ((q_seg, 0), (kv_seg, 1))]
            ok = mask.visible(q_pos, kv_pos, *seg_tiles)
            return jnp.where(ok, s, MASK_VALUE)

        s = lax.cond(kind_ref[b, i, j] == FULL, lambda s: s, apply_mask, s)
        m, alpha, l = wgmma.softmax_weights(s, m, l, p_smem)
        plgpu.barrier_wait(v_bar.at[slot])
        pv = wgmma.matmul(p_smem, v_smem.at[slot], interpret=interpret)
        return wgmma.softmax_accumulate(acc, alpha, pv), m, l

    start = wgmma.softmax_start(block_q, q_smem.shape[1], interpret=interpret)
    acc, _, l = lax.fori_loop(0, count, step, start)
    wgmma.softmax_finish(acc, l, q_smem)
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(i * block_q, block_q), h])
    plgpu.wait_smem_to_gmem(0)


SMEM_BUDGET = 227 * 1024  # bytes of shared memory one CTA may use on H100 / H200 (sm_90)
SMEM_OVERHEAD = 4 * 1024  # barriers, cross-warp reduction scratch, 1 KB alignment of each buffer
BLOCK_KV_CHOICES = (128, 64)  # largest first: fewer loop steps; 64 leaves room for head_dim 256


def smem_bytes(head_dim, dtype, block_q=64, block_kv=128):
    """Shared memory one CTA allocates (the scratch_types below, plus SMEM_OVERHEAD)."""
    tiles = block_q * head_dim + 2 * head_dim * block_kv + 2 * block_kv * head_dim + block_q * block_kv
    return tiles * jnp.dtype(dtype).itemsize + 4 * (block_q + 2 * block_kv) + SMEM_OVERHEAD


def pick_block_kv(head_dim, dtype, block_q=64):
    """The largest kv block whose tiles fit in shared memory, or None when none does."""
    return next((bkv for bkv in BLOCK_KV_CHOICES
                 if smem_bytes(head_dim, dtype, block_q, bkv) <= SMEM_BUDGET), None)


def fits(head_dim, dtype, block_q=64) -> bool:
    """Whether the kernel takes this head_dim and dtype on a GPU: wgmma shapes (head_dim a
    multiple of 64 and at most 256, P @ V's N), 16-bit operands, and the shared-memory budget.
    When it does not, callers take the XLA path (Mosaic GPU would refuse the kernel)."""
    return (head_dim % 64 == 0 and head_dim <= 256 and jnp.dtype(dtype).itemsize == 2
            and pick_block_kv(head_dim, dtype, block_q) is not None)


@functools.partial(jax.jit, static_argnames=(
    "causal", "sliding_window", "soft_cap", "sm_scale", "block_q", "block_kv", "interpret"))
def flash_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None, soft_cap=None,
                    alibi_slopes=None, sm_scale=None, block_q=64, block_kv=None, interpret=False):
    """q [B, T, H, D]; k, v [B, T, KVH, D] (H a multiple of KVH); segment_ids int [B, T] or None;
    alibi_slopes f32[H] or None. Returns [B, T, H, D] like q. Needs D, block_q and block_kv
    multiples of 64 and 16-bit inputs (f32 too when interpreting); block_kv defaults to the largest that fits in shared memory
    (see `fits`; Mosaic GPU refuses a kernel over budget). interpret=True runs in Mosaic GPU
    interpret mode (CPU), with its race detector."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if block_kv is None:
        block_kv = pick_block_kv(d, q.dtype, block_q) or BLOCK_KV_CHOICES[-1]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    if d % 64 or block_q % 64 or block_kv % 64:
        raise ValueError(f"head_dim {d}, block_q {block_q}, block_kv {block_kv}: need multiples of 64")
    if q.dtype.itemsize != 2 and not interpret:
        raise ValueError(f"{q.dtype} inputs: wgmma needs float16 / bfloat16 operands")
    mask = Mask(causal, sliding_window)
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    q, k, v, seg = pad_to_blocks(q, k, v, segment_ids, block_q, block_kv)
    nq = q.shape[1] // block_q
    sched = block_schedule(mask, seg, block_q, block_kv)

    smem = wgmma.tiled_smem(q.dtype, d)
    kernel = plgpu.kernel(
        functools.partial(_kernel, mask=mask, sm_scale=sm_scale, soft_cap=soft_cap, alibi=alibi_slopes is not None,
                          group=h // kvh, block_q=block_q, block_kv=block_kv, interpret=interpret),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[  # what smem_bytes counts
            smem(block_q, d),               # Q, then the output tile
            smem(2, block_kv, d),           # K, double-buffered
            smem(2, block_kv, d),           # V
            smem(block_q, block_kv),        # P
            plgpu.SMEM((block_q,), jnp.int32),
            plgpu.SMEM((2, block_kv), jnp.int32),
            plgpu.Barrier(num_arrivals=2),  # Q + its segment ids
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # K + kv segment ids, per slot
            plgpu.Barrier(num_barriers=2),  # V, per slot
        ],
        grid=(nq, h, b),
        grid_names=("q", "heads", "batch"),
        interpret=wgmma.interpret_params(copies_in_flight=8) if interpret else None,  # Q, 2 x 3
    )
    slopes = () if alibi_slopes is None else (alibi_slopes.astype(jnp.float32),)
    out = kernel(q, k, v, seg, sched.kv_block, sched.kind, sched.count, *slopes)
    return out[:, :t]
