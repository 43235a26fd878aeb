"""Block-sparse flash attention for NVIDIA GPUs (Pallas / Mosaic GPU, Hopper and newer).

Backend: Mosaic GPU, not Pallas' Triton lowering. Triton lowering is deprecated from jax 0.11 and
slated for removal; Mosaic GPU is the Pallas GPU backend JAX maintains and targets the machines we
serve on (H100 / H200: TMA copies, wgmma tensor-core instructions). The cost: it needs sm_90+, no
Ampere, no ROCm, and on CPU the kernel runs under Mosaic GPU's own interpreter, race detector on
(pallas_kernels/wgmma.py). Operands must be 16-bit on a GPU: wgmma on f32 (tf32) cannot read the
row-major V tile. f32 runs in interpret mode only.

One CTA per (q block, q head, batch); a q block of `block_q` rows (128 by default) is split between
block_q // 64 consumer warpgroups (Mosaic GPU threads), each owning 64 rows (wgmma's M) and its own
online softmax. Both read the same K/V tiles in SMEM, so each K/V byte loaded serves 128 q rows.
Two consumers take turns on the tensor cores (`pingpong`, as FlashAttention-3): they meet at a
barrier each step, warpgroup 1 half a step behind, so that one's P @ V and next S = Q @ K^T run
while the other computes its softmax. A third warpgroup, the producer, issues every K/V copy and
nothing else, with 40 registers a thread so that the consumers get 232 (`producer`, up to
head_dim 128; without it warpgroup 0 issues them between its own matmuls). On an H100 (benchmarks/results/kernels_h100.md,
causal, 4k tokens): 512 TFLOP/s with the producer against 460 without, 612 against 536 at 8k. The
CTA reads its visit list from `masks.block_schedule` (at block_q granularity) two steps ahead and
loops over exactly `count` kv blocks, double-buffering K/V/segment-id TMA copies (segment ids only
where the call has them); EMPTY tiles are never copied. The schedule lists the FULL tiles first: a
loop without mask code takes them, a second loop the PARTIAL ones (no branch per step). The tile of step
j goes to the slot that step j - 2 read, once every consumer has arrived on that slot's K (or V)
release barrier: K is released after S and the mask, V after P @ V. S = Q @ K^T reads the K tile
transposed in SMEM; P stays in registers as the P @ V wgmma's A operand, accumulated into the
output in place. GQA: q head h reads kv head h // group straight from K/V, which are never
repeated. Soft cap and ALiBi (the CTA's head's slope, one scalar read) and sinks (the head's sink
logit, one term after the last kv block): pallas_kernels/scores.py.
block_q=64 (one warpgroup), pingpong=False, producer=False and early_k_wait=True are knobs that
benchmarks/kernels.py times beside the default. (Three consumer warpgroups, 192 rows, were slower
at 1k and 4k on the H200 and were dropped.)
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import wgmma
from pallas_kernels.flash_attention.masks import MASK_VALUE, Mask, block_schedule, pad_to_blocks
from pallas_kernels.scores import add_sink, modify_scores, sink_logits


WG_ROWS = 64  # q rows per consumer warpgroup: wgmma's M
# Registers per thread after the producer's split (2 consumers + 1 producer: 232 * 256 + 40 * 128
# of the SM's 65,536); without it each of 3 warpgroups would get 168.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40
BLOCK_Q = 128  # q rows per CTA (2 warpgroups): each K/V tile loaded serves twice the rows of 64


def _kernel(q_ref, k_ref, v_ref, *refs, mask, segments, sm_scale, soft_cap, alibi, sinks, group, block_q, block_kv,
            nq, pingpong, producer, early_k_wait, interpret):
    seg_ref, refs = (refs[0], refs[1:]) if segments else (None, refs)
    kv_block_ref, full_ref, count_ref, *refs = refs
    slope_ref, refs = (refs[0], refs[1:]) if alibi else (None, refs)
    sink_ref, refs = (refs[0], refs[1:]) if sinks else (None, refs)
    o_ref, q_smems, k_smem, v_smem, q_seg_smems, kv_seg_smem, q_bars, k_bar, v_bar, k_free, v_free, *turn = refs
    h, b, wg = (lax.axis_index(name) for name in ("heads", "batch", "wg"))
    # The q axis is the grid's slowest and runs backwards: CTAs start in order of their linear
    # index, so under a causal mask the longest (last q blocks) start first and the GPU's last
    # wave holds the shortest, not a full row of kv blocks.
    i = nq - 1 - lax.axis_index("q")
    kvh = h // group
    consumers = block_q // WG_ROWS
    copier = consumers if producer else 0  # the warpgroup that issues every K/V copy
    count, full = count_ref[b, i], full_ref[b, i]   # steps [0, full) visit FULL tiles, the rest PARTIAL
    last = kv_block_ref.shape[-1] - 1

    def visit(j):
        # Step j's kv block, read from GMEM two steps ahead (see `step`): a load's latency is
        # hundreds of cycles, and its first use would otherwise wait for it.
        return kv_block_ref[b, i, jnp.minimum(j, last)]

    def fetch_k(block, slot):
        kv = pl.ds(block * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(k_ref.at[b, kv, kvh], k_smem.at[slot], k_bar.at[slot])
        if segments:
            plgpu.copy_gmem_to_smem(seg_ref.at[b, kv], kv_seg_smem.at[slot], k_bar.at[slot])

    def fetch_v(block, slot):
        kv = pl.ds(block * block_kv, block_kv)
        plgpu.copy_gmem_to_smem(v_ref.at[b, kv, kvh], v_smem.at[slot], v_bar.at[slot])

    def refill(j, next_block, slot, fetch, free):
        # Without a producer, warpgroup 0 issues every K/V copy. Step j + 1's tile goes to the
        # slot that step j - 1 read, once every warpgroup has let go of it (`free` completes when
        # all have arrived).
        @pl.when((wg == 0) & (j + 1 < count))
        def _():
            pl.when(j > 0)(lambda: plgpu.barrier_wait(free.at[1 - slot]))
            fetch(next_block, 1 - slot)

    first = visit(0)

    def produce():
        # A warpgroup of its own issues the copies, each as soon as its slot is free: no consumer
        # waits for the others' releases. It needs few registers and leaves the rest to them
        # (FlashAttention-3's split; the register counts are attention_mgpu's).
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def issue(j, block):
            slot = lax.rem(j, 2)
            following = visit(j + 1)
            for copy, free in ((fetch_k, k_free), (fetch_v, v_free)):
                pl.when(j >= 2)(functools.partial(plgpu.barrier_wait, free.at[slot]))  # step j - 2's
                copy(block, slot)
            return following

        lax.fori_loop(0, count, issue, first)

    def consume():
        if producer:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
        rows = i * block_q + wg * WG_ROWS  # this warpgroup's first q row
        q_smem, q_seg_smem, q_bar = q_smems.at[wg], q_seg_smems.at[wg], q_bars.at[wg]
        layout = functools.partial(wgmma.layout_cast, interpret=interpret)
        row_layout, col_layout = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(rows, WG_ROWS), h], q_smem, q_bar)
        if segments:
            plgpu.copy_gmem_to_smem(seg_ref.at[b, pl.ds(rows, WG_ROWS)], q_seg_smem, q_bar)
        if not producer:
            @pl.when((wg == 0) & (count > 0))
            def _():
                fetch_k(first, 0)
                fetch_v(first, 0)

        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_bar)
        q_seg = layout(q_seg_smem[...], row_layout) if segments else None
        shape = (WG_ROWS, block_kv)
        iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, shape,
                                 layout=None if interpret else plgpu.Layout.WGMMA)
        slope = None if slope_ref is None else slope_ref[h]
        # Unmodified scores leave sm_scale to the softmax, which folds it into its multiply-add.
        modified = soft_cap is not None or alibi
        scale = 1.0 if modified else sm_scale

        def rendezvous():  # pingpong: both warpgroups meet here (`turn` completes on their two arrivals)
            if pingpong:
                plgpu.barrier_arrive(turn[0])
                plgpu.barrier_wait(turn[0])

        def step(j, carry, masked):
            acc, m, l, block, following = carry   # following: step j + 1's kv block
            ahead = visit(j + 2)
            slot = lax.rem(j, 2)
            with jax.named_scope("k_wait"):  # regions of the kernel's trace (wgmma.compiler_params)
                if not producer:
                    refill(j, following, slot, fetch_k, k_free)
                if not early_k_wait:
                    plgpu.barrier_wait(k_bar.at[slot])
            with jax.named_scope("qk"):
                s = wgmma.matmul(q_smem, k_smem.at[slot], transpose_b=True, interpret=interpret,
                                 while_running=rendezvous)

            def kv_positions():
                # From a column vector, built only where used: registers are tight (test_gpu_compile).
                col = plgpu.broadcasted_iota(jnp.int32, (block_kv,), 0, layout=None if interpret else col_layout)
                return lax.broadcast_in_dim(block * block_kv + col, shape, [1])

            def apply_mask(s):
                q_pos, kv_pos = rows + iota(0), kv_positions()
                seg_tiles = [None, None]
                if segments:
                    kv_seg = layout(kv_seg_smem.at[slot][...], col_layout)
                    # Tiles laid out as S is (jax 0.11's Warpgroup layout inference found no layouts for
                    # the broadcasts of bidirectional masks, nor with these casts: the kernel lowers as Lane).
                    seg_tiles = [layout(lax.broadcast_in_dim(x, shape, [dim]), plgpu.Layout.WGMMA)
                                 for x, dim in ((q_seg, 0), (kv_seg, 1))]
                ok = mask.visible(q_pos, kv_pos, *seg_tiles)
                return jnp.where(ok, s, MASK_VALUE)

            # A tile FULL for the CTA's block is FULL for each warpgroup's rows; a PARTIAL one may
            # hide all of a warpgroup's rows: their weights are 0 (wgmma.softmax_start).
            with jax.named_scope("mask"):
                if modified:
                    s = modify_scores(s * sm_scale, None if slope is None else kv_positions(), soft_cap=soft_cap,
                                      slopes=slope)
                if masked:
                    s = apply_mask(s)
                plgpu.barrier_arrive(k_free.at[slot])  # done with K and the kv segment ids
            with jax.named_scope("softmax"):
                p, acc, m, l = wgmma.online_softmax(s, acc, m, l, scale=scale, dtype=v_smem.dtype)
                if pingpong:  # all of it done before this warpgroup's turn (the compiler may not sink it)
                    p, acc, m, l = lax.optimization_barrier((p, acc, m, l))
            with jax.named_scope("v_wait"):
                if pingpong:  # done with the softmax: the other warpgroup may take the tensor cores
                    plgpu.barrier_arrive(turn[0])
                if not producer:
                    refill(j, following, slot, fetch_v, v_free)
                plgpu.barrier_wait(v_bar.at[slot])
                if pingpong:  # and has issued its S = Q @ K^T: this one's P @ V, then S, go next
                    plgpu.barrier_wait(turn[0])
            def wait_next_k():   # early_k_wait: step j + 1's K tile, while this P @ V runs
                if early_k_wait:
                    pl.when(j + 1 < count)(functools.partial(plgpu.barrier_wait, k_bar.at[1 - slot]))

            with jax.named_scope("pv"):
                acc = wgmma.accumulate_pv(acc, p, v_smem.at[slot], interpret=interpret, while_running=wait_next_k)
                plgpu.barrier_arrive(v_free.at[slot])
            return acc, m, l, following, ahead

        start = wgmma.softmax_start(WG_ROWS, q_smem.shape[-1], scale=scale, interpret=interpret)
        # Pingpong: warpgroup 1 runs half a step behind 0 (one meeting more first, 0 one more last),
        # so that each one's matmuls run while the other computes its softmax.
        if pingpong:
            pl.when(wg == 1)(rendezvous)
        if early_k_wait:   # step 0's K; each step waits for the next one's while its P @ V runs
            pl.when(count > 0)(functools.partial(plgpu.barrier_wait, k_bar.at[0]))
        # The FULL tiles without mask code, then the PARTIAL ones: no branch per step.
        carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (*start, first, visit(1)))
        acc, m, l, *_ = lax.fori_loop(full, count, functools.partial(step, masked=True), carry)
        if pingpong:
            pl.when(wg == 0)(rendezvous)
        with jax.named_scope("finish"):
            if sinks:   # the running max is in base-2 units (wgmma.online_softmax)
                sink = sink_ref[h]
                if alibi:   # each row's sink raised by slope * its (packed) position (scores.py)
                    q_pos = rows + plgpu.broadcasted_iota(jnp.int32, (WG_ROWS,), 0,
                                                          layout=None if interpret else row_layout)
                    sink = sink_logits(sink, slope, q_pos)
                l, alpha = add_sink(m / wgmma.LOG2E, l, sink)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            wgmma.softmax_finish(acc, l, q_smem)
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(rows, WG_ROWS), h])

    if producer:
        pl.when(wg < consumers)(consume)
        pl.when(wg == consumers)(produce)
    else:
        consume()

    def drain(j, _):  # the last two steps' releases, never awaited by a refill
        plgpu.barrier_wait(k_free.at[lax.rem(j, 2)])
        plgpu.barrier_wait(v_free.at[lax.rem(j, 2)])

    # A thread that waits on a barrier must see all its phases (Mosaic GPU's interpreter checks).
    pl.when(wg == copier)(lambda: lax.fori_loop(jnp.maximum(count - 2, 0), count, drain, None))
    plgpu.wait_smem_to_gmem(0)


SMEM_BUDGET = 227 * 1024  # bytes of shared memory one CTA may use on H100 / H200 (sm_90)
SMEM_OVERHEAD = 4 * 1024  # barriers, cross-warp reduction scratch, 1 KB alignment of each buffer
BLOCK_KV_CHOICES = (128, 64)  # largest first: fewer loop steps; 64 leaves room for head_dim 256


def smem_bytes(head_dim, dtype, block_q=BLOCK_Q, block_kv=128):
    """Shared memory one CTA allocates (the scratch_types below, plus SMEM_OVERHEAD)."""
    tiles = block_q * head_dim + 2 * head_dim * block_kv + 2 * block_kv * head_dim
    return tiles * jnp.dtype(dtype).itemsize + 4 * (block_q + 2 * block_kv) + SMEM_OVERHEAD


def pick_block_kv(head_dim, dtype, block_q=BLOCK_Q):
    """The largest kv block whose tiles fit in shared memory, or None when none does."""
    return next((bkv for bkv in BLOCK_KV_CHOICES
                 if smem_bytes(head_dim, dtype, block_q, bkv) <= SMEM_BUDGET), None)


def fits(head_dim, dtype, block_q=BLOCK_Q) -> bool:
    """Whether the kernel takes this head_dim and dtype on a GPU: wgmma shapes (head_dim a
    multiple of 64 and at most 256, P @ V's N), 16-bit operands, and the shared-memory budget.
    When it does not, callers take the XLA path (Mosaic GPU would refuse the kernel)."""
    return (head_dim % 64 == 0 and head_dim <= 256 and jnp.dtype(dtype).itemsize == 2
            and pick_block_kv(head_dim, dtype, block_q) is not None)


@functools.partial(jax.jit, static_argnames=(
    "causal", "sliding_window", "soft_cap", "sm_scale", "block_q", "block_kv", "pingpong", "producer",
    "early_k_wait", "trace_dir", "interpret"))
def flash_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None, soft_cap=None,
                    alibi_slopes=None, sinks=None, sm_scale=None, block_q=None, block_kv=None, trace_dir=None,
                    pingpong=True, producer=None, early_k_wait=False, interpret=False):
    """q [B, T, H, D]; k, v [B, T, KVH, D] (H a multiple of KVH); segment_ids int [B, T] or None;
    alibi_slopes, sinks f32[H] or None. Returns [B, T, H, D] like q. block_q: q rows per CTA, 64 (one
    consumer warpgroup) or 128 (two, the default on a GPU). Needs D and block_kv multiples of 64
    and 16-bit inputs (f32 too when interpreting); block_kv defaults to the largest that fits in
    shared memory (see `fits`; Mosaic GPU refuses a kernel over budget). interpret=True runs in
    Mosaic GPU interpret mode (CPU), with its race detector, on one warpgroup unless block_q says.
    pingpong: two warpgroups take turns on the tensor cores (module docstring); no effect on one.
    producer: a third warpgroup issues the K/V copies (module docstring; two consumer warpgroups
    only), else warpgroup 0 does; None: up to head_dim 128 (above, the consumers' 232 registers
    spill with every feature on, 246 without the split do not: test_gpu_compile). early_k_wait: wait for step j + 1's K tile while step j's P @ V
    runs (as attention_mgpu), not at the start of step j + 1.
    trace_dir: a timeline of the kernel's regions per call (wgmma.compiler_params; GPU only)."""
    b, t, h, d = q.shape
    kvh = k.shape[2]
    if block_q is None:
        # Interpreted, each warpgroup is a program of its own on XLA:CPU's threads; on a 2-core
        # host one warpgroup's program blocked on a barrier while the other's never started, in
        # about half the runs (jax 0.10.2): one warpgroup unless asked (tests ask, in a subprocess).
        block_q = WG_ROWS if interpret else BLOCK_Q
    if block_kv is None:
        block_kv = pick_block_kv(d, q.dtype, block_q) or BLOCK_KV_CHOICES[-1]
    if h % kvh:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {kvh}")
    if block_q not in (WG_ROWS, 2 * WG_ROWS):
        raise ValueError(f"block_q {block_q}: need 64 or 128")
    if d % 64 or block_kv % 64:
        raise ValueError(f"head_dim {d}, block_kv {block_kv}: need multiples of 64")
    if q.dtype.itemsize != 2 and not interpret:
        raise ValueError(f"{q.dtype} inputs: wgmma needs float16 / bfloat16 operands")
    mask = Mask(causal, sliding_window)
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    q, k, v, seg = pad_to_blocks(q, k, v, segment_ids, block_q, block_kv)
    # Without segment ids the kernel reads none (its segment buffers stay unused) unless padding
    # needs them: a causal mask already hides the padding's keys from every real query.
    segments = segment_ids is not None or (not causal and q.shape[1] > t)
    nq = q.shape[1] // block_q
    sched = block_schedule(mask, seg, block_q, block_kv)
    warpgroups = block_q // WG_ROWS
    pingpong = pingpong and warpgroups == 2
    producer = (d <= 128 if producer is None else producer) and warpgroups == 2

    smem = wgmma.tiled_smem(q.dtype, d)
    kernel = plgpu.kernel(
        functools.partial(_kernel, mask=mask, segments=segments, sm_scale=sm_scale, soft_cap=soft_cap,
                          alibi=alibi_slopes is not None, sinks=sinks is not None, group=h // kvh, block_q=block_q,
                          block_kv=block_kv, nq=nq, pingpong=pingpong, producer=producer, early_k_wait=early_k_wait,
                          interpret=interpret),
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_types=[  # what smem_bytes counts; shared by the warpgroups
            smem(warpgroups, WG_ROWS, d),   # each warpgroup's Q rows, then its output rows
            smem(2, block_kv, d),           # K, double-buffered
            smem(2, block_kv, d),           # V
            plgpu.SMEM((warpgroups, WG_ROWS), jnp.int32),
            plgpu.SMEM((2, block_kv), jnp.int32),
            plgpu.Barrier(num_arrivals=1 + segments, num_barriers=warpgroups),  # Q + its segment ids
            plgpu.Barrier(num_arrivals=1 + segments, num_barriers=2),  # K + kv segment ids, per slot
            plgpu.Barrier(num_barriers=2),  # V, per slot
            plgpu.Barrier(num_arrivals=warpgroups, num_barriers=2),  # K slot read by all
            plgpu.Barrier(num_arrivals=warpgroups, num_barriers=2),  # V slot read by all
            *([plgpu.Barrier(num_arrivals=2)] if pingpong else []),  # the warpgroups' turns
        ],
        grid=(h, b, nq),
        grid_names=("heads", "batch", "q"),
        num_threads=warpgroups + producer,
        compiler_params=wgmma.compiler_params("lane", trace_dir, soft_cap=soft_cap),
        thread_name="wg",
        # Q + its segment ids per warpgroup, 2 slots x 3
        interpret=wgmma.interpret_params(copies_in_flight=2 * warpgroups + 6) if interpret else None,
    )
    per_head = [x.astype(jnp.float32) for x in (alibi_slopes, sinks) if x is not None]
    out = kernel(q, k, v, *[seg] * segments, sched.kv_block, sched.full, sched.count, *per_head)
    return out[:, :t]
