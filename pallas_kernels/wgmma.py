"""What the two Mosaic GPU kernels (flash_attention/gpu.py, paged_attention/gpu.py) share: SMEM
tiles laid out as wgmma reads them, a matmul of two such tiles, the online softmax over KV tiles
(P kept in registers as the P @ V wgmma's A operand), and the interpreter settings.

On CPU the kernels run under Mosaic GPU's own interpreter (`InterpretGPUParams`, private in jax
0.10 and 0.11), which simulates SMEM, TMA copies, barriers (their phases exactly) and wgmma, here
with its happens-before race detector on. Its wgmma neither goes through the race detector nor
takes transposed operands, so when interpreting, `matmul` reads both tiles with plain loads (which
the detector checks) and multiplies them with jnp.dot; on a GPU it is one wgmma. Neither does it
know `layout_cast` (layout hints only matter to the compiler): `layout_cast` drops them.
"""
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLES = (128, 64, 32)  # bytes that wgmma reads swizzled; the widest is fastest
MASK_VALUE = -1e30  # finite: scaled (online_softmax), a masked score stays finite
LOG2E = math.log2(math.e)
TRACE_REGIONS = 512  # named regions each warpgroup may enter in a traced call (8 KB of SMEM)


def compiler_params(lowering, trace_dir=None, *, soft_cap=None):
    """Mosaic GPU's settings for a kernel. lowering: its semantics, "lane" or "warpgroup". jax 0.11
    made Warpgroup the default (0.10: Lane), so each kernel names the one it was shown correct
    under on a GPU (an H200, jax 0.11.2), and the compile checks here (jax 0.10) lower what a GPU
    runs: the flash kernel Lane (under Warpgroup, layout inference found no layouts for
    bidirectional masks), the paged kernel Warpgroup (its `lowering` option: its GPU tests and a
    benchmark row try Lane too). trace_dir: Mosaic GPU's profiler records when each warpgroup
    enters and leaves the kernel's named regions (jax.named_scope) and writes one Chrome trace
    per call there (benchmarks/kernel_trace.py); GPU only.

    Approximate math unless the kernel caps its scores (soft_cap): exp2 is then one ex2.approx.ftz
    instruction. The exact lowering (ex2.approx without ftz) wraps each in a compare and two
    predicated multiplies for subnormals, 3 of the softmax's ~8 instructions a score (ptxas's
    SASS for sm_90a); a weight below 2^-126 counts for nothing beside the row's largest, 1. With a
    soft cap the tanh would be approximate too (tanh.approx: 2^-11 relative, up to 0.02 in a logit
    capped at 30), so those kernels stay exact."""
    return plgpu.CompilerParams(lowering_semantics=getattr(plgpu.LoweringSemantics, lowering.capitalize()),
                                approx_math=soft_cap is None,
                                profile_space=TRACE_REGIONS if trace_dir else 0, profile_dir=trace_dir or "")


def tiled_smem(dtype, head_dim):
    """A maker of tiled, swizzled SMEM buffers (TMA copy targets, wgmma operands) for a kernel.
    wgmma needs both operands swizzled alike, so all share the widest swizzle that divides a
    head_dim row (head_dim a multiple of 16 for 16-bit types); tiles are 8 rows by one span."""
    row_bytes = head_dim * jnp.dtype(dtype).itemsize
    swizzle = next(w for w in SWIZZLES if row_bytes % w == 0)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                  plgpu.SwizzleTransform(swizzle))
    return lambda *shape: plgpu.SMEM(shape, dtype, transforms=transforms)


def matmul(a_smem, b_smem, *, transpose_b=False, interpret, while_running=lambda: None):
    """a [M, K] @ b [K, N] in f32 (b stored [N, K] with transpose_b), both SMEM tiles.
    while_running() runs between the wgmma's issue and the wait for its result."""
    if interpret:
        b = b_smem[...]
        while_running()
        return jnp.dot(a_smem[...], b.T if transpose_b else b, preferred_element_type=jnp.float32)
    n = b_smem.shape[0 if transpose_b else 1]

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)) if transpose_b else b_smem)
        while_running()
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((a_smem.shape[0], n), jnp.float32))


def layout_cast(x, layout, *, interpret):
    return x if interpret else plgpu.layout_cast(x, layout)


def softmax_start(rows, head_dim, *, scale, interpret):
    """The online softmax's (output accumulator, running max, running sum) before any KV tile.
    The running max starts halfway to where a MASK_VALUE score lands (see online_softmax): far
    below any real logit, and so far above masked ones that their weights are exactly 0, whatever
    the rounding of a fused multiply-add (a row masked in every tile: softmax_finish)."""
    row = plgpu.Layout.WGMMA.reduce(1)
    return (layout_cast(jnp.zeros((rows, head_dim), jnp.float32), plgpu.Layout.WGMMA, interpret=interpret),
            layout_cast(jnp.full((rows,), MASK_VALUE / 2 * scale * LOG2E, jnp.float32), row, interpret=interpret),
            layout_cast(jnp.zeros((rows,), jnp.float32), row, interpret=interpret))


def online_softmax(scores, acc, m, l, *, scale, dtype):
    """One KV tile of the online softmax, whose logits are scores * scale (scale > 0): the tile's
    weights P (in dtype, V's: the P @ V wgmma's A operand), the output accumulator rescaled to the
    new running max, the new max and sum. All of the tile's work but P @ V itself, so that a
    kernel taking turns on the tensor cores issues that matmul with nothing left before it. The
    max is kept in base-2 units (logits * log2 e), so a weight is one fused multiply-add and one
    ex2 instruction: exp would add a multiply and, unless approximated, a long expansion."""
    c = scale * LOG2E
    m_new = jnp.maximum(m, scores.max(axis=1) * c)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(scores * c - lax.broadcast_in_dim(m_new, scores.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p.astype(dtype), acc, m_new, l * alpha + p.sum(axis=1)


def log_sum_exp(m, l):
    """The natural log-sum-exp of a row's logits from online_softmax's running max and sum."""
    return m / LOG2E + jnp.log(l)


def accumulate_pv(acc, p, v_smem, *, interpret, while_running=lambda: None):
    """acc + P @ V. P stays in registers as wgmma's A operand and the product accumulates into acc
    in place: no P tile in SMEM, no second f32 [M, N] tile. while_running() runs between the
    wgmma's issue and the wait for its result."""
    if interpret:
        v = v_smem[...]
        while_running()
        return acc + jnp.dot(p, v, preferred_element_type=jnp.float32)

    def run(acc_ref):
        plgpu.wgmma(acc_ref, p, v_smem)
        while_running()
    return pl.run_state(run)(plgpu.ACC.init(acc))


def softmax_finish(acc, l, out_smem):
    """The normalized output into out_smem, ready for its copy to GMEM; 0 in a row that saw no
    key (its sum is 0)."""
    inv = 1.0 / jnp.where(l > 0, l, 1.0)  # a division per row, not per element
    out_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_smem.dtype)
    plgpu.commit_smem()


def interpret_params(copies_in_flight):
    """Interpreter settings, race detector on. One simulated TMA engine per copy in flight: with
    fewer, waiting on one copy's barrier would count as waiting for copies issued before it."""
    # Private in jax 0.10 / 0.11; imported here so that the GPU path never depends on it.
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams(detect_races=True, num_tma_threads_per_device=copies_in_flight)
