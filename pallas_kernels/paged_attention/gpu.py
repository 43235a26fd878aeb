"""Ragged paged attention for NVIDIA GPUs (Pallas, Triton lowering).

Backend: Pallas' Triton lowering, selected with `plgpu.CompilerParams`. JAX 0.11 deprecates it
("The Pallas Triton backend is deprecated and will be removed in a future JAX version", warned at
every lowering) in favour of Mosaic GPU, which the flash kernel (flash_attention/gpu.py) uses.
This kernel is not on Mosaic GPU yet because no form of it could be tested on CPU:
  * scores are Q @ K^T with K tiles read as stored, [page_size, D] rows per (page, KV head); on
    Mosaic GPU that is a wgmma with a transposed B operand (`plgpu.transpose_ref`), which its
    interpreter (jax 0.10 / 0.11, the only way to run it without a GPU) does not take: it applies
    index transforms only. The flash kernel transposes K once in XLA; here K is the whole cache,
    so a per-call transpose costs a full pass over the pool;
  * computing K @ Q^T instead moves the transpose to P @ V (V^T as the A operand) or to a
    softmax over the tile's rows (cross-warp reductions);
  * decode has a handful of query rows per KV head, far below wgmma's 64-row tiles.
The port: either a Mosaic GPU interpreter with transposed operands, or decode rows scored on the
CUDA cores (q row broadcast against the K tile, row sums) with P @ V on wgmma. Triton lowering
still ships in jax 0.10.2 and 0.11.x, runs on Ampere too, and `interpret=True` runs this same
kernel on CPU.

Grid (sequence, kv_head, q_chunk). Program (s, h, j) takes up to `block_q` tokens of sequence s
from its j-th chunk, for all query heads of KV head h (the group padded to a power of two): rows
are (token, head in group) and one gathered K/V tile serves the whole group (GQA). It walks the
sequence's pages in chunks of `pages_per_chunk`, from the first page its rows can see (sliding
window) to the last (causal), with an online softmax in f32 registers. A chunk's pages of KV head
h are contiguous [page_size, D] blocks in the [pages, KVH, page_size, D] layout. Programs past a
sequence's q_len exit at once; rows past it are never stored. No split over the KV length: a
long decode with few sequences fills few SMs.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -1e30


def _kernel(qsl_ref, seq_lens_ref, page_table_ref, q_ref, k_ref, v_ref, o_ref, *,
            block_q, group, pages_per_chunk, sm_scale, sliding_window):
    s, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    page_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    rows, chunk = block_q * group, pages_per_chunk * page_size
    q_start, q_end = qsl_ref[s], qsl_ref[s + 1]
    t0 = q_start + j * block_q

    @pl.when(t0 < q_end)
    def _():
        offset = seq_lens_ref[s] - q_end  # token t sits at position t + offset
        last = jnp.minimum(q_end, t0 + block_q) - 1
        page_end = lax.div(last + offset, page_size) + 1
        page_lo = 0
        if sliding_window is not None:
            page_lo = lax.div(jnp.maximum(t0 + offset - sliding_window + 1, 0), page_size)
        q = q_ref[pl.ds(t0, block_q), h, :, :].reshape(rows, head_dim)
        q_pos = t0 + offset + lax.div(jnp.arange(rows, dtype=jnp.int32), group)

        def body(c, carry):
            acc, m, l = carry
            first_page = page_lo + c * pages_per_chunk
            page_ids = first_page + jnp.arange(pages_per_chunk, dtype=jnp.int32)
            # Pages past the sequence's end read page 0 instead: finite, and masked below.
            pages = plgpu.load(page_table_ref.at[s, pl.ds(first_page, pages_per_chunk)],
                               mask=page_ids < page_end, other=0)
            k = k_ref[pages, h, :, :].reshape(chunk, head_dim)
            v = v_ref[pages, h, :, :].reshape(chunk, head_dim)
            scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * sm_scale
            kv_pos = first_page * page_size + jnp.arange(chunk, dtype=jnp.int32)
            mask = kv_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
            scores = jnp.where(mask, scores, MASK_VALUE)
            m_next = jnp.maximum(m, jnp.max(scores, axis=1))
            alpha = jnp.exp(m - m_next)
            p = jnp.where(mask, jnp.exp(scores - m_next[:, None]), 0.0)
            pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return acc * alpha[:, None] + pv, m_next, l * alpha + jnp.sum(p, axis=1)

        init = (jnp.zeros((rows, head_dim), jnp.float32),
                jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
        num_chunks = lax.div(page_end - page_lo + pages_per_chunk - 1, pages_per_chunk)
        acc, _, l = lax.fori_loop(0, num_chunks, body, init)
        out = (acc / l[:, None]).reshape(block_q, group, head_dim).astype(o_ref.dtype)
        valid = (t0 + jnp.arange(block_q, dtype=jnp.int32)) < q_end
        plgpu.store(o_ref.at[pl.ds(t0, block_q), h, :, :], out, mask=valid[:, None, None])


def _pow2(n):
    return 1 << max(0, n - 1).bit_length()


@functools.partial(jax.jit, static_argnames=(
    "max_q", "sm_scale", "sliding_window", "block_rows", "kv_block", "num_warps", "num_stages",
    "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *,
                           max_q, sm_scale, sliding_window=None, block_rows=64, kv_block=64,
                           num_warps=4, num_stages=2, interpret=False):
    """q [T, H, D]; k/v pages [N, KVH, page_size, D]; page_table int32[S, P]; seq_lens int32[S];
    query_start_loc int32[S + 1]; max_q: static bound on any sequence's q_len (sets the grid).
    Returns [T, H, D], 0 for tokens outside [query_start_loc[0], query_start_loc[-1]).

    block_rows: target (token x head) rows per program (>= 16, Triton's smallest dot);
    kv_block: keys per chunk (a multiple of page_size). head_dim and page_size must be powers
    of two (Triton block shapes)."""
    t, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs, pages_per_seq = page_table.shape
    group = num_heads // num_kv_heads
    if head_dim != _pow2(head_dim) or page_size != _pow2(page_size) or kv_block % page_size:
        raise ValueError(f"head_dim {head_dim} and page_size {page_size} must be powers of two, "
                         f"kv_block {kv_block} a multiple of page_size")
    group_p = _pow2(group)
    block_q = max(min(_pow2(max_q), block_rows // group_p), pl.cdiv(16, group_p), 1)
    pages_per_chunk = kv_block // page_size

    # Pad so that every slice the kernel takes is in bounds: tokens by block_q, the group to a
    # power of two, page-table columns by a chunk.
    qp = q.reshape(t, num_kv_heads, group, head_dim)
    qp = jnp.pad(qp, ((0, block_q), (0, 0), (0, group_p - group), (0, 0)))
    table = jnp.pad(page_table, ((0, 0), (0, pages_per_chunk)))

    kernel = functools.partial(
        _kernel, block_q=block_q, group=group_p, pages_per_chunk=pages_per_chunk,
        sm_scale=sm_scale, sliding_window=sliding_window)
    out = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, pl.cdiv(max_q, block_q)),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(query_start_loc, seq_lens, table, qp, k_pages, v_pages)
    out = out[:t, :, :group].reshape(t, num_heads, head_dim)
    # Tokens outside [query_start_loc[0], query_start_loc[-1]) belong to no program: never written.
    tok = jnp.arange(t)
    owned = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    return jnp.where(owned[:, None, None], out, 0)
