"""Ragged paged attention for NVIDIA GPUs (Pallas / Mosaic GPU, Hopper and newer).

Backend: Mosaic GPU, like the flash kernel (flash_attention/gpu.py says why; pallas_kernels/
wgmma.py how its interpreter runs both on CPU). Pallas' Triton lowering, which this kernel used
before, is deprecated from jax 0.11.

Grid (q chunk, kv head, sequence). Program (j, h, s) takes `block_q` = 64 // group tokens of
sequence s from its j-th chunk, for all query heads of KV head h: its 64 rows are (token, head
in group), the M of one wgmma, so one K/V tile serves the whole group (GQA). Q and the output
come in 64-row blocks, one per program, scattered and gathered by XLA around the kernel
(`_blocks`): a program's Q is one TMA copy that starts at a multiple of 64 rows, as a copy into
tiled SMEM must (jax 0.11's Mosaic GPU refuses other starts), and its output leaves in one copy
without touching a neighbouring sequence's rows. It walks the sequence's KV in tiles of
`kv_block` keys, from the first tile its rows can see (sliding window) to the last (causal):
each tile is `kv_block / page_size` page copies ([page_size, D] blocks of KV head h in the
[pages, KVH, page_size, D] layout), double-buffered as in the flash kernel, with an online
softmax in f32 registers. S = Q @ K^T reads the K tile transposed in SMEM; P stays in registers
as the P @ V wgmma's A operand, accumulated into the output in place. Decode wastes most of
the 64 rows (its q_len is 1); it is bound by reading K/V. Soft cap and ALiBi:
pallas_kernels/scores.py; ALiBi slopes arrive one per row (its head's), copied to SMEM with Q.

Split KV: a decode step of few sequences has few programs (one per sequence and KV head) and
would leave most SMs idle while each walks a long context alone. With `kv_splits` > 1 the q
axis of the grid also numbers splits: split c of a program's tiles takes the c-th run of
ceil(tiles / kv_splits) of them and writes its own output and each row's log-sum-exp, which XLA
then merges (`_merge_splits`). The default picks splits from the static shapes (`pick_kv_splits`).
Sinks (pallas_kernels/scores.py) join at that merge, once: with sinks a program writes its rows'
log-sum-exp even unsplit, and the merge of its one part adds the sink (with ALiBi, raised by
slope * the token's position: scores.py).

Quantized pools (int8, fp8 e4m3; jaxserve/kv_cache.py): the pages' TMA copies land in SMEM in
their own dtype (double-buffered, half the bytes of a bf16 tile), and each page's per-slot f32
scales of KV head h beside them (loaded by the threads: too small for TMA); once a tile is in,
it is dequantized (stored * scale, 64 rows at a time in registers) into one tile in q's dtype
that the wgmmas read. The copies of the next tile stay in flight meanwhile. Pools in q's dtype
skip all of this.

Without V pages (the values are the keys: latent attention) a tile's K operand serves as its V:
one copy per page, and nothing to wait for before P @ V.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import wgmma
from pallas_kernels.scores import modify_scores, sink_logits

MASK_VALUE = wgmma.MASK_VALUE
ROWS = 64  # (token, head in group) rows per program: wgmma's M


def _kernel(qsl_ref, seq_lens_ref, table_ref, q_ref, *refs, q_smem, kv_smem, o_smem, q_bar, kv_bar,
            slope_smem=None, stored_smem=None, scale_smem=None, lse_smem=None,
            group, block_q, pages_per_tile, kv_splits, sm_scale, sliding_window, soft_cap, alibi, lse, interpret):
    # Inputs after q: the K (and V) pages [N, KVH, page_size, D], [ALiBi slopes [KVH, ROWS]], [their
    # scales [N, KVH, 1, lanes]], then the output [splits, KVH, rows, D] (and with lse, each row's
    # log-sum-exp [splits, KVH, rows]). kv_smem, kv_bar: the K (and V) operand tiles and copy
    # barriers; quantized, stored_smem and scale_smem are their pages and scales as copied in.
    pools = len(kv_smem)   # 1: the values are the keys
    refs, outs = (refs[:-2], refs[-2:]) if lse else (refs[:-1], refs[-1:])
    page_refs, refs = refs[:pools], refs[pools:]
    slope_ref, *scale_refs = refs if alibi else (None, *refs)
    quantized = bool(scale_refs)
    k_ref = page_refs[0]
    jc, h, s = lax.axis_index("q"), lax.axis_index("kv_heads"), lax.axis_index("seqs")
    j, split = lax.div(jc, kv_splits), lax.rem(jc, kv_splits)
    page_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    tile = pages_per_tile * page_size
    q_start, q_end = qsl_ref[s], qsl_ref[s + 1]
    t0 = q_start + j * block_q

    @pl.when(t0 < q_end)
    def _():
        seq_len = seq_lens_ref[s]
        offset = seq_len - q_end  # token t sits at position t + offset
        last = jnp.minimum(q_end, t0 + block_q) - 1
        page_end = lax.div(last + offset, page_size) + 1  # pages past it are never needed
        tile_lo = 0
        if sliding_window is not None:
            tile_lo = lax.div(jnp.maximum(t0 + offset - sliding_window + 1, 0), tile)
        tiles = lax.div(last + offset, tile) + 1 - tile_lo
        per_split = lax.div(tiles + kv_splits - 1, kv_splits)
        tile_lo += split * per_split   # this split's run of tiles; the last runs may be short or empty
        count = jnp.clip(tiles - split * per_split, 0, per_split)

        plgpu.copy_gmem_to_smem(q_ref.at[h, _block_rows(t0, s, block_q)], q_smem, q_bar)
        if alibi:
            plgpu.copy_gmem_to_smem(slope_ref.at[h], slope_smem, q_bar)
        landing = stored_smem if quantized else kv_smem   # where K and V pages are copied to
        scales = tuple(zip(scale_refs, scale_smem)) if quantized else ()

        def tile_pages(c):
            # Tile c's pages; past the sequence's last page, that page again (masked below). Read a
            # step before their copies are issued: a copy waiting on its page-table load (GMEM
            # latency) would hold up the copies after it.
            first = (tile_lo + c) * pages_per_tile
            return tuple(table_ref[s, jnp.minimum(first + p, page_end - 1)] for p in range(pages_per_tile))

        def fetch(pages, slot):
            for p, page in enumerate(pages):
                rows = pl.ds(p * page_size, page_size)
                for src, dst, bar in zip(page_refs, landing, kv_bar):
                    plgpu.copy_gmem_to_smem(src.at[page, h], dst.at[slot, rows], bar.at[slot])
                # A page's scales of head h (4 bytes a slot) are too few bytes for a TMA copy
                # (whole 128 bytes): the threads load them, unrolled so the loads overlap.
                for src, dst in scales:
                    for i in range(page_size):
                        dst[slot, p * page_size + i] = src[page, h, 0, i]

        def load(tile_ref):
            return tile_ref[...] if interpret else plgpu.load(tile_ref, (), layout=plgpu.Layout.WGMMA)

        def zero_rows_from(tile_ref, n):
            # 64 rows at a time: a whole 128-key tile in registers beside P and the output
            # accumulator spilled (tests/test_gpu_compile.py).
            for r in range(0, tile, ROWS):
                block = tile_ref.at[pl.ds(r, ROWS)]
                x = load(block)
                rows = r + plgpu.broadcasted_iota(jnp.int32, x.shape, 0,
                                                  layout=None if interpret else plgpu.Layout.WGMMA)
                block[...] = jnp.where(rows < n, x, jnp.zeros_like(x))
            plgpu.commit_smem()

        def operand(kv, slot):
            """The K (kv 0) or V (1) tile of `slot` as wgmma reads it, once its copies are in."""
            if not quantized:
                return kv_smem[kv].at[slot]
            stored, scale, dst = stored_smem[kv].at[slot], scale_smem[kv].at[slot], kv_smem[kv]
            for r in range(0, tile, ROWS):   # 64 rows at a time: a wgmma-layout block of registers
                rows = pl.ds(r, ROWS)
                row_scale = wgmma.layout_cast(scale.at[rows][...], plgpu.Layout.WGMMA.reduce(1), interpret=interpret)
                x = load(stored.at[rows]).astype(jnp.float32)
                dst.at[rows][...] = (x * lax.broadcast_in_dim(row_scale, x.shape, [0])).astype(dst.dtype)
            plgpu.commit_smem()
            return dst

        pl.when(count > 0)(lambda: fetch(tile_pages(0), 0))
        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_bar)
        shape = (ROWS, tile)
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, shape,
                                 layout=None if interpret else plgpu.Layout.WGMMA)
        q_pos = t0 + offset + lax.div(iota(0), group)
        # Unmodified scores leave sm_scale to the softmax, which folds it into its multiply-add.
        modified = soft_cap is not None or alibi
        scale = 1.0 if modified else sm_scale
        slopes = None
        if alibi:
            slopes = lax.broadcast_in_dim(wgmma.layout_cast(slope_smem[...], plgpu.Layout.WGMMA.reduce(1),
                                                            interpret=interpret), shape, [0])

        def step(c, carry):
            acc, m, l, pages = carry   # pages: tile c + 1's
            slot = lax.rem(c, 2)
            with jax.named_scope("k_wait"):  # regions of the kernel's trace (wgmma.compiler_params)
                pl.when(c + 1 < count)(lambda: fetch(pages, 1 - slot))  # the other slot was freed at c - 1
                pages = tile_pages(c + 2)
                plgpu.barrier_wait(kv_bar[0].at[slot])
            with jax.named_scope("qk"):
                k_tile = operand(0, slot)
                scores = wgmma.matmul(q_smem, k_tile, transpose_b=True, interpret=interpret)
            with jax.named_scope("mask"):
                kv_pos = (tile_lo + c) * tile + iota(1)
                if modified:
                    scores = modify_scores(scores * sm_scale, kv_pos, soft_cap=soft_cap, slopes=slopes)
                visible = kv_pos <= q_pos
                if sliding_window is not None:
                    visible &= kv_pos > q_pos - sliding_window
                scores = jnp.where(visible, scores, MASK_VALUE)
            with jax.named_scope("softmax"):
                p, acc, m, l = wgmma.online_softmax(scores, acc, m, l, scale=scale, dtype=q_smem.dtype)
            with jax.named_scope("v_wait"):
                v_tile = k_tile   # the values are the keys: S = Q K^T is done with the tile
                if pools == 2:
                    plgpu.barrier_wait(kv_bar[1].at[slot])
                    v_tile = operand(1, slot)
                # The last tile's slots past the sequence's length hold stale (maybe inf or NaN)
                # data, which a zero weight does not cancel: zero them in V.
                kv0 = (tile_lo + c) * tile
                pl.when(kv0 + tile > seq_len)(lambda: zero_rows_from(v_tile, seq_len - kv0))
            with jax.named_scope("pv"):
                return wgmma.accumulate_pv(acc, p, v_tile, interpret=interpret), m, l, pages

        start = wgmma.softmax_start(ROWS, head_dim, scale=scale, interpret=interpret)
        acc, m, l, _ = lax.fori_loop(0, count, step, (*start, tile_pages(1)))
        with jax.named_scope("finish"):
            rows = _block_rows(t0, s, block_q)
            if lse:   # an empty split (l = 0) gives 0 and a log-sum-exp of -inf: no weight
                lse_smem[...] = wgmma.log_sum_exp(m, l)
            wgmma.softmax_finish(acc, l, o_smem)
            for src, out in zip((o_smem, lse_smem), outs):
                plgpu.copy_smem_to_gmem(src, out.at[split, h, rows])
            plgpu.wait_smem_to_gmem(0)


def _block_rows(t0, s, block_q):
    """The rows of the block of the program of tokens t0.. of sequence s (see `_blocks`)."""
    return pl.ds(pl.multiple_of((lax.div(t0, block_q) + s) * ROWS, ROWS), ROWS)


def _blocks(query_start_loc, t, num_seqs, block_q, group):
    """Block rows of the (token, head in group) rows, [t, group], and the number of blocks.

    The program of tokens t0.. (block_q of them) of sequence s has block t0 // block_q + s:
    sequence s starts at block query_start_loc[s] // block_q + s, past the ceil(q_len / block_q)
    blocks of the one before, and there are at most cdiv(t, block_q) + num_seqs blocks. Tokens
    outside [query_start_loc[0], query_start_loc[-1]) belong to no block: their rows are past the
    last (dropped when scattered, 0 when gathered)."""
    num_blocks = pl.cdiv(t, block_q) + num_seqs
    tok, seq = _token_seqs(query_start_loc, t, num_seqs)
    local = tok - query_start_loc[seq]
    first = ((tok - local % block_q) // block_q + seq) * ROWS + local % block_q * group
    owned = (tok >= query_start_loc[0]) & (tok < query_start_loc[-1])
    return jnp.where(owned, first, num_blocks * ROWS)[:, None] + jnp.arange(group), num_blocks


def _token_seqs(query_start_loc, t, num_seqs):
    """The t tokens' indices and each one's sequence (tokens of no sequence: the nearest one's)."""
    tok = jnp.arange(t)
    # compare_all: one fusion. The default binary search is a loop whose every step launches
    # kernels on a GPU: 17 of the 24 launches of a decode call (B=64), whose host dispatch bound it.
    return tok, jnp.clip(jnp.searchsorted(query_start_loc, tok, side="right", method="compare_all") - 1,
                         0, num_seqs - 1)


def _positions(query_start_loc, seq_lens, t):
    """Each of the t tokens' position in its sequence (tokens of no sequence: any finite value)."""
    tok, seq = _token_seqs(query_start_loc, t, seq_lens.shape[0])
    return tok + seq_lens[seq] - query_start_loc[seq + 1]


def _merge_splits(out, lse, sinks=None):
    """out [splits, ..., D], lse [splits, ...]: each split's softmax output and log-sum-exp,
    merged into one output [..., D]. sinks (broadcastable to lse[0]) or None: each row's sink
    logit, one more term of the softmax's sum with no output."""
    top = lse.max(axis=0) if sinks is None else jnp.maximum(lse.max(axis=0), sinks)
    weights = jnp.exp(lse - top)
    total = weights.sum(axis=0) if sinks is None else weights.sum(axis=0) + jnp.exp(sinks - top)
    weights = weights / total
    return (weights[..., None] * out.astype(jnp.float32)).sum(axis=0).astype(out.dtype)


def fits(head_dim: int, quantized: bool = False) -> bool:
    """Whether the kernel takes this head_dim: wgmma's K and N, a multiple of 16 up to 256 (of
    32 for quantized pools: a row of whole 32-byte swizzle spans). Latent attention's 576 is not."""
    return head_dim % (32 if quantized else 16) == 0 and head_dim <= 256


# Programs that keep every SM of an H100 / H200 (132) busy: two resident per SM, as a program's
# SMEM (about 100 KB at head_dim 128) allows.
BUSY_PROGRAMS = 2 * 132
MIN_TILES_PER_SPLIT = 4   # a split's tiles amortize its Q copy, output and merge


def pick_kv_splits(programs, max_tiles):
    """KV splits for a grid of `programs` (q blocks x KV heads x sequences) over sequences of at
    most `max_tiles` KV tiles (the page table's width): enough to fill the GPU, none that would be
    left with fewer than MIN_TILES_PER_SPLIT tiles of the longest sequence."""
    return max(1, min(-(-BUSY_PROGRAMS // max(programs, 1)), max_tiles // MIN_TILES_PER_SPLIT))


@functools.partial(jax.jit, static_argnames=("max_q", "sm_scale", "sliding_window", "soft_cap", "kv_block",
                                             "kv_splits", "lowering", "trace_dir", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *,
                           max_q, sm_scale, sliding_window=None, soft_cap=None, alibi_slopes=None, sinks=None,
                           k_scale=None, v_scale=None, kv_block=64, kv_splits=None, lowering="warpgroup",
                           trace_dir=None, interpret=False):
    """q [T, H, D]; k/v pages [N, KVH, page_size, D]; page_table int32[S, P]; seq_lens int32[S];
    query_start_loc int32[S + 1]; max_q: static bound on any sequence's q_len (sets the grid).
    v_pages None (and v_scale None): the values are the keys, read from the K tiles.
    Returns [T, H, D], 0 for tokens outside [query_start_loc[0], query_start_loc[-1]).
    soft_cap, alibi_slopes, sinks (f32[H] or None): pallas_kernels/scores.py. k_scale, v_scale: f32
    [N, KVH, 1, lanes >= page_size] or None: quantized pools (int8, fp8; jaxserve/kv_cache.py) hold
    K / scale and V / scale per (slot, KV head), slot s's in lane s; each tile is dequantized in
    SMEM (module docstring).

    kv_block: keys per tile, a multiple of 64 and of page_size (or page_size itself when larger).
    kv_splits: how many parts each program's KV tiles are split into (module docstring); None:
    `pick_kv_splits`. lowering: Mosaic GPU's lowering semantics, "warpgroup" (shown correct on a
    GPU) or "lane"; trace_dir: a timeline of the kernel's regions per call (wgmma.compiler_params).
    Needs D a multiple of 16 up to 256 (of 32 for quantized pools: a row of whole 32-byte swizzle
    spans), H / KVH at most 64, 16-bit inputs on a GPU (f32 too when interpreting), page_size a
    multiple of 8 (page copies fill whole 8-row SMEM tiles). interpret=True runs in Mosaic GPU
    interpret mode (CPU), race detector on."""
    t, num_heads, head_dim = q.shape
    _, num_kv_heads, page_size, _ = k_pages.shape
    num_seqs = page_table.shape[0]
    group = num_heads // num_kv_heads
    tile = max(kv_block, page_size)
    quantized = k_scale is not None
    if not fits(head_dim, quantized) or tile % 64 or tile % page_size or group > ROWS:
        raise ValueError(f"head_dim {head_dim}: need a multiple of {32 if quantized else 16} up to 256 (wgmma's "
                         f"K and N); kv tile {tile}: a multiple of 64 and of page_size {page_size}; "
                         f"group {group}: at most {ROWS}")
    if q.dtype.itemsize != 2 and not interpret:
        raise ValueError(f"{q.dtype} inputs: wgmma needs float16 / bfloat16 operands")
    block_q, pages_per_tile = ROWS // group, tile // page_size
    q_blocks_per_seq = pl.cdiv(max_q, block_q)
    if kv_splits is None:
        kv_splits = pick_kv_splits(q_blocks_per_seq * num_kv_heads * num_seqs,
                                   page_table.shape[1] * page_size // tile)

    # Q rows (token, head in group) of each KV head in the programs' blocks.
    rows, num_blocks = _blocks(query_start_loc, t, num_seqs, block_q, group)
    # Gathered, not scattered into zeros: XLA:GPU allocates a scatter's zeros early, so every
    # layer's blocks would be live at once (17 MiB a layer at 128 sequences).
    sources = jnp.full(num_blocks * ROWS, t * group).at[rows.ravel()].set(jnp.arange(t * group), mode="drop")
    qg = q.reshape(t, num_kv_heads, group, head_dim).transpose(1, 0, 2, 3).reshape(num_kv_heads, t * group, head_dim)
    q_blocks = qg.at[:, sources].get(mode="fill", fill_value=0)

    alibi = alibi_slopes is not None
    # Row (token, head in group) of KV head h: its head's slope.
    slopes = (jnp.tile(alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, group), (1, block_q)),) if alibi else ()

    smem = wgmma.tiled_smem(q.dtype, head_dim)
    # Pages land double-buffered in the wgmma operands, or quantized in their own buffers and are
    # dequantized into one operand tile each.
    operand_tile = (tile, head_dim) if quantized else (2, tile, head_dim)
    pools = (k_pages,) if v_pages is None else (k_pages, v_pages)
    scratch = dict(
        q_smem=smem(ROWS, head_dim), kv_smem=[smem(*operand_tile) for _ in pools],
        o_smem=plgpu.SMEM((ROWS, head_dim), q.dtype),  # output, untiled
        q_bar=plgpu.Barrier(num_arrivals=1 + alibi),  # Q (and slopes)
        kv_bar=[plgpu.Barrier(num_arrivals=pages_per_tile, num_barriers=2) for _ in pools])  # pages, per slot
    if alibi:
        scratch["slope_smem"] = plgpu.SMEM((ROWS,), jnp.float32)  # ALiBi slopes of the rows
    out_type = jax.ShapeDtypeStruct((kv_splits, *q_blocks.shape), q.dtype)
    lse = kv_splits > 1 or sinks is not None
    if lse:
        scratch["lse_smem"] = plgpu.SMEM((ROWS,), jnp.float32)
        out_type = (out_type, jax.ShapeDtypeStruct(out_type.shape[:-1], jnp.float32))
    scales = ()
    if quantized:
        scales = tuple(x.astype(jnp.float32) for x in (k_scale, v_scale)[:len(pools)])
        stored = wgmma.tiled_smem(k_pages.dtype, head_dim)
        scratch.update(stored_smem=[stored(2, tile, head_dim) for _ in pools],
                       scale_smem=[plgpu.SMEM((2, tile), jnp.float32) for _ in pools])
    copies_in_flight = 1 + alibi + len(pools) * 2 * pages_per_tile  # Q (and slopes), then pages of both slots
    kernel = plgpu.kernel(
        functools.partial(_kernel, group=group, block_q=block_q, pages_per_tile=pages_per_tile, kv_splits=kv_splits,
                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, alibi=alibi,
                          lse=lse, interpret=interpret),
        out_type=out_type,
        scratch_types=scratch,
        grid=(q_blocks_per_seq * kv_splits, num_kv_heads, num_seqs),
        compiler_params=wgmma.compiler_params(lowering, trace_dir, soft_cap=soft_cap),
        grid_names=("q", "kv_heads", "seqs"),
        interpret=wgmma.interpret_params(copies_in_flight) if interpret else None,
    )
    out = kernel(query_start_loc, seq_lens, page_table, q_blocks, *pools, *slopes, *scales)
    # The tokens' rows, [splits, KVH, t, group, D] (lse without D), merged after the gather: it
    # drops the rows that hold no token (most of a decode block's) and those no program wrote.
    gather = lambda x: x.at[:, :, rows].get(mode="fill", fill_value=0)  # noqa: E731
    if lse:   # sinks: each row's (KV head, head in group) sink logit, as [KVH, 1, group]
        sink_rows = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group)
        if sink_rows is not None and alibi:   # raised by slope * the token's position: [KVH, t, group]
            sink_rows = sink_logits(sink_rows, alibi_slopes.astype(jnp.float32).reshape(num_kv_heads, 1, group),
                                    _positions(query_start_loc, seq_lens, t)[:, None])
        out = _merge_splits(*map(gather, out), sink_rows)
    else:
        out = gather(out)[0]
    return out.transpose(1, 0, 2, 3).reshape(t, num_heads, head_dim)
