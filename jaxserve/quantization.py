"""Quantized Linear weights: weight-only int8 (one scale per output channel), int4 (one scale
per group of 128 inputs, two values packed per byte) and fp8 (float8 e4m3, a scale per group of
128 inputs), and w8a8: int8 weights as int8's, with the activations quantized to int8 per token
at run time, so the matmul is an int8 x int8 -> int32 dot.

A quantized Linear holds `qweight` and a scale in place of `weight` ([out, in] as before):
  * int8: qweight int8 [out, in], scale f32 [out];
  * int4: qweight uint8 [out, in / 2] (byte k of a group of 128 inputs: input k in the low
    nibble, input k + 64 in the high one), scale f32 [out, in / 128];
  * int4_asym: int4's, and zero f32 [out, in / 128], each group's zero point as an offset:
    weight = code * scale - zero. A group's 16 levels span its own minimum to maximum rather than
    +-its largest magnitude (AWQ's and asymmetric GPTQ's checkpoints); the offsets cost one more
    small product per Linear, of each group's input sum;
  * fp8: qweight float8_e4m3fn [out, in], scale f32 [out, in / 128], int4's scale layout. It holds
    exactly each scale an FP8 checkpoint may store (jaxserve/prequantized.py): a 128x128 block's
    (DeepSeek's and Qwen's -FP8) is its 128 rows' scale for one group of inputs, a channel's or the
    tensor's the same in every group: 4 bytes per 128 weights (3% of the fp8 bytes) where [out] would
    do, one mode with one params tree. Load-time `fp8` scales each group by its largest magnitude / 448;
  * w8a8: qweight int8 [out, in], channel_scale f32 [out] (the activations' per-token scales exist only in the step).
A mixture's stacked expert weight [experts, out, in] (EXPERT_MODES) is each expert's Linear
weight quantized alike: its param becomes {"qweight", "scale"} (int4_asym's with "zero") with a leading experts axis
(jaxserve/models/experts.py dequantizes them as its products consume them); MXFP4, gpt-oss's
checkpoints' experts alone, holds jaxserve/mxfp4.py's leaves (a uint8 scale says so).
The mode is read from the scale's name, rank and dtype and the qweight's dtype (int4: uint8, fp8:
float8_e4m3fn): the params tree alone says how to multiply.

w8a8 is the CPU's fast int8 path: XLA CPU has an int8 x int8 dot (2.5x the f32 dot at 16 rows of
a [8192, 2048] weight, 1.7x at one row: benchmarks/results/quantization.md), and none that takes
int8 weights with float activations. Its cost is accuracy: each token's activations are rounded
to 255 levels of their largest magnitude, which models with outlier activation channels (large
LLMs) feel; the held-out perplexity of tests/test_quantized_engine.py bounds it on the tiny model.
fp8 is weight-only too (W8A16): activations stay in the model dtype and the weight is converted
to it inside the dot, as vLLM serves FP8 checkpoints on GPUs without fp8 arithmetic; TPU v5e has
no fp8 matrix unit, and on every backend this keeps one formulation (an fp8 x fp8 dot with scaled
activations would be a w8a8-like mode of its own).
int4 is packed into uint8 by hand, not held as jnp.int4: on XLA CPU a jnp.int4 array takes a byte a
value on device, and orbax stores uint8 as any other dtype; unpacking (two shifts) fuses on every backend.

Embeddings and the LM head stay in the model dtype by default. With `lm_head` (engine config
`quantize_lm_head`) the head is quantized too, in the same mode: an untied `lm_head` Linear as any
other, and a head tied to the embeddings gets its own quantized copy of the table, `lm_head`'s
qweight and scale (one per vocabulary row), used for the logits while the token lookup keeps
gathering rows of the full-precision table. On a 100M model with 32000 tokens the f32 table is
most of the bytes a w8a8 decode step reads (benchmarks/results/quantization.md).

Dequantization happens inside the fused computation. On TPU and GPU XLA fuses the convert
and the scaling into the dot's operand (int4 on TPU still relays out the packed bytes:
benchmarks/results/quantization.md). XLA TPU first broadcasts int4's and fp8's grouped scales to
the weight's shape in VMEM, 86% of a [12288, 4096] fp8 weight's dot at 8 tokens on v5e by its
cycle estimate; so on one TPU chip, up to TPU_GROUP_ROWS rows (decode), the scales multiply each
group's partial product instead (_group_rows_dot: 0.17x those cycles at 8 tokens on v5e, 0.06x
on v6e; benchmarks/results/quantization_fp8.md); more rows, and tensor parallelism, keep the
broadcast. XLA CPU does not fuse: it converts the whole weight to a temporary f32 buffer before
every dot (a full-precision copy per step, 2-11x slower than f32), so on CPU the matmul runs over
blocks of output rows in a loop, each block dequantized into a small buffer that stays in cache
(tests/test_quantization.py checks the compiled buffers on CPU and TPU).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxserve import mxfp4
from jaxserve.config import QUANTIZATION_MODES as MODES
from jaxserve.matmul import matmul_t

SCALES = {"int8": "scale", "int4": "scale", "int4_asym": "scale", "fp8": "scale", "w8a8": "channel_scale"}   # each mode's scale leaf
ZERO = "zero"                 # int4_asym's zero-point offsets
LEAVES = ("qweight", "scale", "channel_scale", ZERO)   # what a quantized Linear may hold instead of `weight`
GROUP = 128                   # int4, fp8: inputs per scale
HEAD = "lm_head"              # the LM head's Linear, kept in the model dtype unless asked
TIED_EMBEDDING = ("model", "embed_tokens", "embedding")   # every family's table, [vocab, hidden]
EXPERTS = "experts"           # layers.SparseMoE's stacked expert weights, quantized in EXPERT_MODES
MXFP4 = "mxfp4"               # a mode of checkpoints only: experts as stored, the rest unquantized
EXPERT_MODES = ("int8", "int4", "int4_asym", "fp8", MXFP4)   # w8a8's activations have no expert product
ROUTERS = ("gate", "shared_expert_gate")   # MoE routers' Linears, kept in the model dtype: their outputs pick and weigh experts
BLOCK_ELEMENTS = 1 << 15      # CPU: weight elements dequantized at once (128 KiB in f32)
# TPU: rows up to which int4 and fp8 take _group_rows_dot (the smallest decode bucket): its dot
# is groups x rows wide, 32 x 8 rows for 4096 inputs already as many MXU FLOPs per weight byte as
# a v5e has per HBM byte (~240), so past that it is compute-bound where the old program is not.
TPU_GROUP_ROWS = 8


def check_mode(mode: str | None) -> None:
    if mode is not None and mode not in (*MODES, MXFP4):
        raise ValueError(f"quantization must be one of {', '.join(MODES)} or null, got {mode!r}")


def quantize_weight(w, mode: str) -> dict:
    """{"qweight", "scale"} of a Linear weight [out, in] (symmetric, round to nearest); of a stack
    [experts, out, in], each expert's alike, stacked."""
    if mode == MXFP4:
        return mxfp4.quantize(w)
    w = jnp.asarray(w, jnp.float32)
    if w.ndim == 3:
        return jax.vmap(functools.partial(quantize_weight, mode=mode))(w)
    out, inp = w.shape
    if mode in ("int8", "w8a8"):
        q, scale = quantize_rows(w, jnp.int8)
        return {"qweight": q, SCALES[mode]: scale}
    if inp % GROUP:
        raise ValueError(f"{mode} quantization needs a weight's input size to be a multiple of {GROUP}, got {inp}")
    groups = w.reshape(out, inp // GROUP, GROUP)
    if mode == "fp8":
        q, scale = quantize_rows(groups, jnp.float8_e4m3fn)
        return {"qweight": q.reshape(out, inp), "scale": scale}
    if mode == "int4":
        scale = _nonzero(jnp.max(jnp.abs(groups), axis=2) / 7)
        codes = jnp.clip(jnp.round(groups / scale[..., None]), -7, 7).astype(jnp.int8)
        return {"qweight": pack_int4(codes.reshape(out, inp)), "scale": scale}
    # int4_asym: the levels from the group's minimum to its maximum (0 among them, so zeros stay exact)
    low, high = jnp.minimum(jnp.min(groups, axis=2), 0), jnp.maximum(jnp.max(groups, axis=2), 0)
    scale = _nonzero((high - low) / 15)
    point = jnp.round(-low / scale)                       # the level of 0, 0..15
    codes = jnp.clip(jnp.round(groups / scale[..., None]) + point[..., None], 0, 15) - 8
    return {"qweight": pack_int4(codes.astype(jnp.int8).reshape(out, inp)), "scale": scale,
            ZERO: (point - 8) * scale}


def pack_int4(codes):
    """int8 codes [out, in] in -8..7 (a numpy or a jax array) as int4's qweight uint8 [out, in / 2]:
    byte k of a group of 128 inputs holds input k in its low nibble and input k + 64 in its high one."""
    out, inp = codes.shape
    nibbles = (codes.astype(jnp.uint8) & 0xF).reshape(out, inp // GROUP, GROUP)
    half = GROUP // 2
    return (nibbles[..., :half] | (nibbles[..., half:] << 4)).reshape(out, inp // 2)


_LARGEST = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0}


def quantize_rows(x, dtype):
    """x [..., n] -> (x in `dtype` (int8 or fp8), float32 [...] scales) with x ~= stored * scale:
    each row's largest magnitude maps to the dtype's largest value (an all-zero row: scale 1).
    Rows: a KV cache's head vectors (kv_cache.py), int8 weights' output channels, w8a8's tokens,
    fp8 weights' groups of 128 inputs."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.where(amax > 0, amax / _LARGEST[jnp.dtype(dtype)], 1.0)
    scaled = x.astype(jnp.float32) / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return scaled.astype(dtype), scale


def _nonzero(scale):
    return jnp.where(scale == 0, 1.0, scale)   # an all-zero row quantizes to zeros with any scale


def _grouped_parts(qweight, scale, dtype):
    """A weight with a scale per group of 128 inputs (int4, fp8) dequantized in parts, each
    [out, in / parts], part p holding the p-th slice of every group: fp8's whole weight; int4's
    two halves, since byte k of a group holds input k in its low nibble and input k + 64 in its
    high one, so unpacking is two shifts and no interleaving (which XLA CPU runs several times slower)."""
    out = qweight.shape[0]

    def scaled(q):   # [out, in / parts] times its groups' scales, in `dtype`: XLA TPU fuses that into
        # the dot, where in f32 it materialized the scales broadcast to the weight's shape in HBM at
        # real sizes (192 MiB for a [12288, 4096] fp8 weight; tests/test_quantization.py). With bf16
        # the scales round to 8 bits, as a checkpoint's bf16 or fp16 scales already are.
        q = q.reshape(out, scale.shape[1], -1)
        return (q.astype(dtype) * scale.astype(dtype)[..., None]).reshape(out, -1)
    return [scaled(p) for p in _stored_parts(qweight)]


def _stored_parts(qweight):
    """_grouped_parts' parts unscaled: fp8's weight as it is, int4's halves as int8 codes."""
    if qweight.dtype != jnp.uint8:
        return [qweight]
    as_int8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int8)
    # sign-extending shifts: the nibble to the top, then back down
    return [jax.lax.shift_right_arithmetic(as_int8(high), jnp.int8(4)) for high in (qweight << 4, qweight)]


def dequantize(qweight, scale, dtype=jnp.float32, zero=None):
    """The weight [out, in] that qweight and scale (and int4_asym's zero) stand for."""
    if scale.dtype == jnp.uint8:
        return mxfp4.dequantize_jnp(qweight, scale, dtype)
    if scale.ndim == 1:
        return (qweight.astype(jnp.float32) * scale[:, None]).astype(dtype)
    out, groups = scale.shape
    parts = [p.reshape(out, groups, -1) for p in _grouped_parts(qweight, scale, jnp.float32)]
    if zero is not None:   # in each part: subtracted after the concatenation, XLA:TPU kept a chunk
        # of experts dequantized in memory (25 MiB against 0.8: benchmarks/results/expert_parallel.md)
        parts = [p - zero[..., None] for p in parts]
    return jnp.concatenate(parts, axis=-1).reshape(out, -1).astype(dtype)


def _dot(x, qweight, scale, zero, dtype):
    """x @ W.T with W dequantized as an operand of the dot (fused on TPU and GPU). int8 scales
    multiply the output; grouped weights are a dot per part (int4: the inputs of each group's
    first and second halves), and with zero points one more, of each group's input sum by its offsets."""
    def dot(a, w):
        return jax.lax.dot_general(a, w, (((a.ndim - 1,), (1,)), ((), ())))
    if scale.ndim == 1:
        return dot(x, qweight.astype(dtype)) * scale.astype(dtype)
    parts = _grouped_parts(qweight, scale, dtype)
    xg = x.reshape(*x.shape[:-1], -1, len(parts), GROUP // len(parts))
    y = sum(dot(xg[..., p, :].reshape(*x.shape[:-1], -1), w) for p, w in enumerate(parts))
    return y if zero is None else y - _zero_product(x, zero, dtype)


def _group_rows_dot(x, qweight, scale, zero, dtype):
    """TPU, grouped weights (int4, fp8) at few rows: x @ W.T with the scales on each group's partial
    product instead of on the weight. Each row of x is repeated once per group, each copy keeping
    only its group's inputs (zeros elsewhere), so one plain dot with the unscaled weight gives every
    group's partial product, [rows, groups, out], which the scales then multiply in f32. XLA:TPU
    materializes the scales broadcast to the weight's shape in VMEM before a dot that scales the
    weight (86% of its estimated cycles for a [12288, 4096] fp8 weight at 8 tokens on v5e); here
    nothing weight-sized is broadcast, but the dot multiplies `groups` times as many rows, which
    pays up to TPU_GROUP_ROWS rows (benchmarks/results/quantization_fp8.md)."""
    out, groups = scale.shape
    parts = _stored_parts(qweight)
    xg = x.reshape(-1, groups, len(parts), GROUP // len(parts))
    own = jnp.eye(groups, dtype=bool)[:, :, None]    # [the copy's group, the inputs' group, 1]

    def partial(p, w):   # [rows, groups, out]: each group's product with part p's inputs
        copies = jnp.where(own, xg[:, None, :, p], 0).reshape(xg.shape[0], groups, w.shape[1])
        return jax.lax.dot_general(copies, w.astype(dtype), (((2,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    products = sum(partial(p, w) for p, w in enumerate(parts))
    y = jnp.sum(products * scale.T, axis=1).astype(dtype).reshape(*x.shape[:-1], out)
    return y if zero is None else y - _zero_product(x, zero, dtype)


def _tpu_dot(x, qweight, scale, zero, dtype):
    """_dot, or for grouped weights at up to TPU_GROUP_ROWS rows (decode steps) on one chip
    _group_rows_dot. Rows are static, so the choice is made once per compiled step shape. Under
    tensor parallelism XLA splits a row-parallel weight over its inputs and would all-reduce the
    [rows, groups, out] f32 products, 2 x groups times the bytes of _dot's [rows, out]; the
    traced weight shows only its mesh, not its split, so any "model" axis over 1 keeps _dot."""
    one_chip = jax.typeof(qweight).sharding.mesh.shape.get("model", 1) == 1
    if scale.ndim == 2 and one_chip and x.size // x.shape[-1] <= TPU_GROUP_ROWS:
        return _group_rows_dot(x, qweight, scale, zero, dtype)
    return _dot(x, qweight, scale, zero, dtype)


def _zero_product(x, zero, dtype):
    """int4_asym: what the zero points take off x @ W.T, each group's input sum times its offsets."""
    sums = jnp.sum(x.reshape(*x.shape[:-1], -1, GROUP).astype(jnp.float32), axis=-1)   # [..., in / 128]
    return jax.lax.dot_general(sums, zero, (((sums.ndim - 1,), (1,)), ((), ()))).astype(dtype)


def num_blocks(out: int, inp: int) -> int:
    """CPU: row blocks of the weight, a power of two dividing `out`, each at most
    BLOCK_ELEMENTS when possible, and at least 2 whenever `out` is even (so no block is the
    whole weight; every projection of the supported families has an even `out`)."""
    nb = 2
    while out % (nb * 2) == 0 and (out // nb) * inp > BLOCK_ELEMENTS:
        nb *= 2
    return nb if out % nb == 0 else 1


def _blocked_dot(x, qweight, scale, zero, dtype):
    """_dot over blocks of output rows in a loop. Block j holds rows j, j + nb, j + 2 nb, ...:
    the row dim splits as [rows / nb, nb], so a weight sharded over its rows keeps its shards.
    fp8 goes into the loop as its bytes: XLA CPU has no fp8 arithmetic and, given an fp8 array
    to slice, converts all of it to f16 before the loop. The bytes are a copy too (XLA CPU does
    not take the bitcast for a view; it tried u8 and u32 views, sliced inside or outside the
    loop): one byte a weight written per step, where int8 slices its weight in place."""
    out, stored = qweight.shape[0], qweight.dtype
    nb = num_blocks(out, x.shape[-1])
    as_bytes = jax.lax.bitcast_convert_type(qweight, jnp.uint8) if jnp.issubdtype(stored, jnp.floating) else qweight
    q3 = as_bytes.reshape(out // nb, nb, *qweight.shape[1:])
    s3 = scale.reshape(out // nb, nb, *scale.shape[1:])

    def block(j):
        pick = functools.partial(jax.lax.dynamic_index_in_dim, index=j, axis=1, keepdims=False)
        return _dot(x, jax.lax.bitcast_convert_type(pick(q3), stored), pick(s3), None, dtype)

    y = jax.lax.map(block, jnp.arange(nb))               # [nb, ..., out / nb]
    y = jnp.moveaxis(y, 0, -1).reshape(*x.shape[:-1], out)
    return y if zero is None else y - _zero_product(x, zero, dtype)   # small: outside the loop, once


def _int8_dot(x, qweight, scale, zero, dtype):
    """w8a8: x quantized per token, an int8 x int8 -> int32 dot (exact: |sum| <= 127^2 * in, under
    2^31 for up to 133,000 inputs; on CPU by columns for few rows, jaxserve/matmul.py), then the
    token's and the channel's scales."""
    xq, x_scale = quantize_rows(x, jnp.int8)
    acc = matmul_t(xq, qweight, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * x_scale[..., None] * scale).astype(dtype)


def _int8_dot_two_rows(x, qweight, scale, zero, dtype):
    """CPU: _int8_dot with at least two rows. XLA CPU's int8 dot of a single row takes a path
    17x slower than two rows (measured on a [8192, 2048] weight), so one row is doubled."""
    if x.size != x.shape[-1]:
        return _int8_dot(x, qweight, scale, zero, dtype)
    flat = x.reshape(1, -1)
    return _int8_dot(jnp.concatenate([flat, flat]), qweight, scale, zero, dtype)[:1].reshape(*x.shape[:-1], -1)


def matmul(x, qweight, scale, dtype, int8_activations: bool = False, zero=None):
    """x @ W.T for a quantized W, in `dtype`: weight-only (int8 by its scale's rank, int4 and fp8
    by the qweight's dtype; int4_asym with its `zero` offsets), or with int8_activations w8a8's int8 x int8 dot. The
    formulation is chosen by the platform the program is lowered for (compile-only TPU devices on
    a CPU host included)."""
    x = x.astype(dtype)
    cpu, tpu, default = (_int8_dot_two_rows, _int8_dot, _int8_dot) if int8_activations else (_blocked_dot, _tpu_dot, _dot)
    return jax.lax.platform_dependent(x, qweight, scale, zero, cpu=functools.partial(cpu, dtype=dtype),
                                      tpu=functools.partial(tpu, dtype=dtype), default=functools.partial(default, dtype=dtype))


def quantizable(keys: tuple[str, ...], leaf, lm_head: bool = False, mode: str | None = None) -> bool:
    """Whether the param at `keys` is a weight to quantize: a Linear's but a router's (the LM
    head's with `lm_head`), or a stack of experts' (not their biases); in `mode` MXFP4 the stacks only."""
    if keys[-2:-1] == (EXPERTS,):
        return len(leaf.shape) == 3
    return (mode != MXFP4 and len(keys) >= 2 and keys[-1] == "weight" and len(leaf.shape) == 2
            and keys[-2] not in ROUTERS and (keys[-2] != HEAD or lm_head))


def quantized_node(keys: tuple[str, ...]) -> tuple[str, ...]:
    """Where the leaves of the quantizable weight at `keys` go: its Linear's module, or a stack
    of experts' own param (a Linear's bias stays beside its leaves; a stack's biases are params of their own)."""
    return keys if keys[-2:-1] == (EXPERTS,) else keys[:-1]


def weight_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """The unquantized weight's keys of the quantized leaf at `keys` (quantized_node's inverse)."""
    return keys[:-1] if keys[-3:-2] == (EXPERTS,) else keys[:-1] + ("weight",)


def set_path(tree: dict, keys: tuple[str, ...], value) -> None:
    """tree[k0][k1]... = value, creating dicts on the way; a dict value is merged in."""
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    if isinstance(value, dict):
        tree.setdefault(keys[-1], {}).update(value)
    else:
        tree[keys[-1]] = value


def check_head(mode: str | None, lm_head: bool) -> None:
    if lm_head and mode is None:
        raise ValueError(f"quantize_lm_head needs a quantization mode ({', '.join(MODES)})")


def quantize_params(params, mode: str | None, shardings=None, lm_head: bool = False):
    """The params tree with every Linear weight but the LM head's quantized (mode None: as is),
    the head's too with `lm_head` (tied: a quantized copy of the embedding table, see tied_head);
    `shardings`, when given, are the quantized tree's, and each weight's result is placed so."""
    check_mode(mode)
    check_head(mode, lm_head)
    if mode is None:
        return params
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        if quantizable(keys, leaf, lm_head, mode):
            at = quantized_node(keys)
            set_path(out, at, quantize_placed(leaf, mode, None if shardings is None else node(shardings, at)))
        else:
            set_path(out, keys, leaf)
    if lm_head:
        tied_head(out, mode, shardings)
    return out


def tied_head(params: dict, mode: str, shardings=None) -> None:
    """A tied model's (no `lm_head` in params) quantized head, added to params as `lm_head`: the
    embedding table quantized as a Linear weight [vocab, hidden], scales per vocabulary row."""
    if HEAD not in params:
        params[HEAD] = quantize_placed(node(params, TIED_EMBEDDING), mode,
                                       None if shardings is None else node(shardings, (HEAD,)))


def quantize_placed(weight, mode: str, shardings: dict | None) -> dict:
    """quantize_weight, its leaves placed by `shardings` (None: where jit puts them)."""
    out = None if shardings is None else tuple(sorted((k, v) for k, v in shardings.items() if k in LEAVES))
    return _quantizer(mode, out)(weight)


@functools.cache
def _quantizer(mode: str, out_shardings: tuple | None):
    """One jitted quantize_weight per mode and placement: a model's layers repeat a few weight
    shapes, so each compiles once (a jit made per weight compiled every weight again)."""
    return jax.jit(functools.partial(quantize_weight, mode=mode),
                   out_shardings=None if out_shardings is None else dict(out_shardings))


def node(tree: dict, keys: tuple[str, ...]):
    for k in keys:
        tree = tree[k]
    return tree


def logical_axes(name: str, weight_axes: tuple[str, ...], ndim: int) -> tuple[str, ...]:
    """Logical axes of a quantized leaf, from its weight's: qweight as the weight, a scale as the
    weight's first `ndim` axes (int8: the output channel; int4, fp8: output and input groups)."""
    return weight_axes if name == "qweight" else weight_axes[:ndim]


def weight_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
