"""The one attention entry point of the models, and its backend dispatch.

Two modes:
  * no KV cache (training, full-sequence scoring): dense causal attention over [B, T].
  * paged (serving): a ragged batch of new tokens, flattened to [T]. Sequence s owns tokens
    query_start_loc[s]:query_start_loc[s+1]; they sit at the end of its seq_lens[s] KV entries.
    Their K/V are first written into the page pool at `slot_mapping`, then every token attends
    causally to its sequence's pages through the page table.

Kernels per backend: "xla" runs pallas_kernels/paged_attention/xla.py (CPU serving). The Pallas
backends run the paged kernel of their platform, and in steps with prefill rows also the
block-sparse flash kernel (pallas_kernels/flash_attention) where it takes the shapes (GPU:
head_dim a multiple of 64): the prefill rows without a cached prefix, which the runner packs
first, attend with flash over the packed new K/V, every other row through the paged kernel
(`_pallas_rows`). No lax.cond picks between them: on a GPU each would hold the host until the
device reached it.

KV layout: jaxserve/kv_cache.py (the one place it is described). The hybrid KV cache
(jaxserve/kv_groups.py) changes no kernel: a layer gets its group's pool entry and page table
(AttentionMetadata.group). A sliding group's entries before its window are NULL_PAGE, which holds
zeros: the TPU kernel starts at the window's first page; the XLA path (from the block of the
batch's lowest window start) and the GPU kernel (from a tile's) may read such entries, and mask
them, and zeros give no NaN through a zero weight (a reused page there might).
"""
from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxserve.kv_cache import LayerKV
from jaxserve.parallel import gather_tokens
from pallas_kernels.flash_attention.reference import causal_attention
from pallas_kernels.paged_attention import xla as paged_xla

BACKENDS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
# XLA path: decode rows attend in groups of this many, each group reading K/V only up to its own
# longest row (the runner orders decode rows longest first, so groups hold similar lengths).
DECODE_GROUP_ROWS = 16


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array        # int32[T] absolute position of each new token
    slot_mapping: jax.Array     # int32[T] page * page_size + offset; out of range (padding) = not written
    page_table: jax.Array       # int32[S, P]
    seq_lens: jax.Array         # int32[S] KV length after this step (0 = empty slot)
    query_start_loc: jax.Array  # int32[S + 1] offsets of each sequence's tokens in the flat batch
    max_q: int = struct.field(pytree_node=False, default=1)  # static bound on any sequence's new tokens
    # Rows [0, num_prefill_rows) may bring up to max_q tokens, later (decode) rows at most
    # decode_q (1, or 1 + k proposals with speculative decoding), so the XLA path pads decode
    # rows to [S, decode_q] rather than [S, max_q]. None: one group.
    num_prefill_rows: int | None = struct.field(pytree_node=False, default=None)
    decode_q: int = struct.field(pytree_node=False, default=1)
    backend: str = struct.field(pytree_node=False, default="xla")
    # Platform of the devices the arrays live on ("cpu", "tpu", "gpu"); None: the default
    # device's. Not jax.default_backend() at trace time: a CPU host compiling for TPU
    # devices must reach Mosaic, not the interpreter.
    platform: str | None = struct.field(pytree_node=False, default=None)
    # Under a mesh (parallel.py): the page pools' sharding, re-asserted after the K/V write so
    # XLA does not reshard the cache to suit the attention math (that costs a cache all-gather).
    kv_sharding: object = struct.field(pytree_node=False, default=None)
    # Sequence-parallel prefill (sequence_parallel.py): q is this shard's chunk; the new K/V
    # are all-gathered over this mesh axis so every shard writes the whole prompt's K/V.
    seq_axis: str | None = struct.field(pytree_node=False, default=None)


    def group(self, g: int) -> "AttentionMetadata":
        """The metadata of KV group g's layers (page_table [G, S, P] and slot_mapping [G, T] of a
        hybrid cache, jaxserve/kv_groups.py: each group's pages of the same tokens)."""
        return self.replace(page_table=self.page_table[g], slot_mapping=self.slot_mapping[g])


def resolve_backend(name: str = "auto", platform: str | None = None, head_dim: int | None = None,
                    kv_cache_dtype: str = "auto") -> str:
    """`auto` picks the Pallas kernel of the platform (of the mesh's devices; None: the default
    device's), and the XLA path on CPU, and on a GPU whose paged kernel does not take the model's
    head_dim (None: any) in its KV pools (of kv_cache_dtype)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; choose one of {BACKENDS}")
    if name != "auto":
        return name
    platform = platform or jax.default_backend()
    if platform in ("gpu", "cuda") and not _hopper_or_newer():
        return "xla"   # the GPU kernels are Mosaic GPU, which needs sm_90 (Hopper) or newer
    if platform in ("gpu", "cuda") and head_dim is not None and not importlib.import_module(
            "pallas_kernels.paged_attention.gpu").fits(head_dim, kv_cache_dtype != "auto"):
        return "xla"
    return {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}.get(platform, "xla")


def _hopper_or_newer() -> bool:
    """Whether the local GPU has compute capability 9.0 or more (True when no GPU can be asked,
    as for compile-only devices, which Mosaic GPU targets as sm_90)."""
    try:
        capability = jax.devices("gpu")[0].compute_capability
    except (RuntimeError, AttributeError):
        return True
    return float(capability) >= 9.0


def attend(q, k, v, kv: LayerKV | None, meta: AttentionMetadata | None, *, sliding_window: int | None,
           sm_scale: float, soft_cap: float | None = None, alibi_slopes=None, sinks=None):
    """q [.., H, D], k/v [.., KVH, D]; kv: this layer's pages (None: dense attention, no cache;
    without a V pool, kv.v None, v must be k: the values are the keys, read from the K pages).
    Returns (output like q, the updated LayerKV or None). soft_cap: scores become
    soft_cap * tanh(scores / soft_cap) (Gemma 2). alibi_slopes: f32[H] for all H query heads
    (BLOOM, MPT), or None: slope * key position is added to the scores (pallas_kernels/scores.py).
    sinks: f32[H] for all H query heads (gpt-oss), or None: each head's learned logit joins the
    softmax as one more column, which takes weight and gives no output (pallas_kernels/scores.py)."""
    if kv is None:
        return causal_attention(q, k, v, sliding_window=sliding_window, sm_scale=sm_scale, soft_cap=soft_cap,
                                alibi_slopes=alibi_slopes, sinks=sinks), None
    head_dim = q.shape[-1]
    if kv.k.shape[-1] > head_dim:   # a TPU pool's padded lanes (pool_head_dim): zeros in q,
        # k and v leave every score unchanged and give zero output lanes, sliced off below.
        q, k, v = (jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, kv.k.shape[-1] - head_dim),))
                   for x in (q, k, v))
    if meta.seq_axis is not None:
        k, v = (gather_tokens(x, meta.seq_axis, meta.kv_sharding) for x in (k, v))
    # k, v from here on: as the pools hold them
    kv, (k, v) = kv.write(k, v, meta.slot_mapping, meta.platform or jax.default_backend())
    if meta.kv_sharding is not None:
        kv = kv.constrain(meta.kv_sharding)
    out = paged_attention(q, kv, meta, sliding_window=sliding_window, sm_scale=sm_scale,
                          soft_cap=soft_cap, alibi_slopes=alibi_slopes, sinks=sinks, k=k, v=v)
    return out[..., :head_dim], kv


def paged_attention(q, kv: LayerKV, meta: AttentionMetadata, *, sliding_window, sm_scale,
                    soft_cap=None, alibi_slopes=None, sinks=None, k=None, v=None):
    """Ragged paged attention of q [T, H, D] through the page table to a layer's pages. The
    Pallas backends run in interpret mode when the arrays live on CPU (tests). k, v [T, KVH, D]:
    this step's new K/V, already in the pages and as the pools give them back (LayerKV.write:
    a quantized pool's rounding included), which let the Pallas backends run fresh prefill rows
    through the flash kernel with the attention the pages would give. alibi_slopes, sinks:
    f32[H] of all query heads, or None; under tensor parallelism each device gets its heads'."""
    tables = (meta.page_table, meta.seq_lens, meta.query_start_loc)
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if meta.backend == "xla":
        kwargs.update(alibi_slopes=alibi_slopes, sinks=sinks, k_scale=kv.k_scale, v_scale=kv.v_scale)
        p = meta.num_prefill_rows
        if p is None:
            return paged_xla.ragged_paged_attention(q, kv.k, kv.v, *tables, max_q=meta.max_q, **kwargs)
        # Prefill rows pad to max_q tokens, decode rows to decode_q; each call zeroes the others' tokens.
        page_table, seq_lens, qsl = tables
        out = _decode_rows_in_groups(q, kv.k, kv.v, page_table[p:], seq_lens[p:], qsl[p:],
                                     max_q=meta.decode_q, **kwargs)
        if p:
            out += paged_xla.ragged_paged_attention(q, kv.k, kv.v, page_table[:p], seq_lens[:p], qsl[:p + 1],
                                                    max_q=meta.max_q, **kwargs)
        return out
    if meta.backend not in ("pallas_gpu", "pallas_tpu"):
        raise ValueError(f"attention backend {meta.backend!r} is not available")
    # Imported on first use: the Pallas Triton / Mosaic modules cost a fraction of a second.
    kernels = meta.backend.removeprefix("pallas_")
    interpret = (meta.platform or jax.default_backend()) == "cpu"
    kernel = importlib.import_module(f"pallas_kernels.paged_attention.{kernels}")
    paged = functools.partial(_paged_kernel, kernel.ragged_paged_attention, **kwargs, interpret=interpret)
    kv_axis = _kv_head_axis(meta.kv_sharding)
    head_axis = kv_axis or _query_head_axis(meta.kv_sharding, q.shape[1], kv.k.shape[1])
    heads, kv_heads = P(None, head_axis, None), P(None, kv_axis, None)
    pools = jax.tree.map(lambda x: P(None, kv_axis, *(None,) * (x.ndim - 2)), kv)   # pages and scales
    args, specs = (q, kv, *tables), (heads, pools, P(), P(), P())
    flash = None
    if _flash_fits(meta, q, k, interpret):
        flash = importlib.import_module(f"pallas_kernels.flash_attention.{kernels}").flash_attention
        flash = functools.partial(flash, interpret=interpret, **kwargs)
        args, specs = args + (k, v), specs + (kv_heads, kv_heads)
    if interpret:
        paged, flash = _waited_for(paged), flash and _waited_for(flash)
    call = functools.partial(_pallas_rows, paged=paged, flash=flash, num_prefill_rows=meta.num_prefill_rows,
                             max_q=meta.max_q, decode_q=meta.decode_q)
    per_head = {name: x.astype(jnp.float32) for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks))
                if x is not None}
    if per_head:   # the last arguments, split with the query heads
        args, specs = args + tuple(per_head.values()), specs + (P(head_axis),) * len(per_head)
        call = functools.partial(_per_head_last, call, tuple(per_head))
    if head_axis is None or not hasattr(meta.kv_sharding, "mesh"):   # inside shard_map: XLA partitions
        return call(*args)
    # Tensor parallelism: XLA cannot partition a Pallas call (it would gather the whole cache to
    # every device), so each device runs the kernels on its own KV heads and their query heads;
    # a group never straddles devices since both split evenly. One replicated KV head
    # (multi-query: MQA, DeepSeek's latent attention) serves every device's query heads.
    return jax.shard_map(call, mesh=meta.kv_sharding.mesh, in_specs=specs, out_specs=heads,
                         check_vma=False)(*args)


def _per_head_last(call, names, *args):
    """call with its last len(names) arguments passed as those keywords."""
    return call(*args[:-len(names)], **dict(zip(names, args[-len(names):])))


def _decode_rows_in_groups(q, k_pages, v_pages, page_table, seq_lens, query_start_loc, *, max_q, **kwargs):
    """XLA path: rows of at most max_q new tokens, DECODE_GROUP_ROWS at a time in one loop. Each
    group reads K/V only up to its own longest row; as a loop (not one call per group) the step
    holds one group's code whatever its row count: it compiles faster, measured 6-7% faster on
    the CPU offline workload (its prefill steps), and keeps the step's JIT-mapped code sections
    (a few per kernel, bounded by vm.max_map_count) from growing with max_num_seqs."""
    rows = page_table.shape[0]
    if not rows:
        return jnp.zeros_like(q)
    g = min(DECODE_GROUP_ROWS, rows)
    n = -(-rows // g)
    pad = n * g - rows   # empty rows: no tokens, no KV
    page_table, seq_lens = jnp.pad(page_table, ((0, pad), (0, 0))), jnp.pad(seq_lens, (0, pad))
    query_start_loc = jnp.pad(query_start_loc, (0, pad), mode="edge")

    def group(i, out):
        def rows_of(x, size):
            return lax.dynamic_slice_in_dim(x, i * g, size)
        return out + paged_xla.ragged_paged_attention(q, k_pages, v_pages, rows_of(page_table, g), rows_of(seq_lens, g),
                                                      rows_of(query_start_loc, g + 1), max_q=max_q, **kwargs)

    return lax.fori_loop(0, n, group, jnp.zeros_like(q))


def _flash_fits(meta: AttentionMetadata, q, k, interpret: bool) -> bool:
    """Whether a step's prefill rows may take the flash kernel (see its docstrings): the step
    has prefill rows and their new K/V came along; on a real GPU the Mosaic GPU kernel says
    which shapes it takes (`fits`: wgmma shapes, 16-bit operands, shared memory), and the
    interpreter only needs head_dim a multiple of 64. The TPU kernel takes any shape."""
    if not meta.num_prefill_rows or k is None:
        return False
    if meta.backend == "pallas_tpu":
        return True
    if interpret:
        return q.shape[-1] % 64 == 0
    return importlib.import_module("pallas_kernels.flash_attention.gpu").fits(q.shape[-1], q.dtype)


def _waited_for(kernel):
    """An interpreted kernel (CPU) that, called eagerly (tests; under jit it is traced and waits for
    nothing), returns once it has run. XLA:CPU runs a device's computations in the order they were
    dispatched, each holding one of the device's in-flight slots (a semaphore in its Execute) until
    it has run, and the interpreters' host callbacks dispatch JAX operations of their own (jax
    0.10.2 hands them their arguments as jax.Arrays: the TPU interpreter's get/store iterate the
    grid point, its device barrier multiplies the device id). With attend's eager operations queued
    behind a running kernel and the slots gone, the kernel's next callback waited for a slot that
    only the kernel's end would free: a hang using no CPU (test_paged_attention, 1 run in 13 beside
    another job; 3 in 3 with the interpreter's callbacks slowed)."""
    def call(*args, **kwargs):
        out = kernel(*args, **kwargs)
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(out)):
            jax.block_until_ready(out)
        return out
    return call


def _paged_kernel(kernel, q, kv: LayerKV, *tables, **kwargs):
    """A paged kernel's call with a layer's pools (and their scales, None unless quantized)."""
    return kernel(q, kv.k, kv.v, *tables, k_scale=kv.k_scale, v_scale=kv.v_scale, **kwargs)


def _pallas_rows(q, kv, page_table, seq_lens, qsl, k=None, v=None, *, paged, flash, num_prefill_rows,
                 max_q, decode_q, alibi_slopes=None, sinks=None):
    """A step's rows through the Pallas kernels, with no run-time branch (on a GPU a lax.cond
    stops the host until the device hands it the predicate, once per layer):
      * the leading prefill rows whose K/V are all in this step (no cached prefix; the runner
        puts such rows first) attend with `flash` (None: no such path) over the new K/V;
      * the other prefill rows with the paged kernel, its grid sized for max_q tokens a row;
      * the decode rows with the paged kernel sized for decode_q tokens a row, over their tokens.
    Each call gives 0 for the tokens it does not take, so the output is their sum."""
    paged = functools.partial(paged, alibi_slopes=alibi_slopes, sinks=sinks)
    p = num_prefill_rows
    if not p:
        return paged(q, kv, page_table, seq_lens, qsl, max_q=max_q)
    out = _decode_rows(paged, q, kv, page_table, seq_lens, qsl, first=p, decode_q=decode_q)
    lead = jnp.int32(0)
    if flash is not None:
        # The flash kernel sees only this step's K/V, and masks by in-row index. A row without
        # cached prefix (first chunk of a prompt, no prefix hit) has all its K/V in this step, and
        # packed back to back its in-row indices keep its positions' order and differences (all
        # that the masks and ALiBi, which adds slope * key index, need).
        fresh = seq_lens[:p] == qsl[1:p + 1] - qsl[:p]
        lead = jnp.sum(jnp.cumprod(fresh.astype(jnp.int32)))
        tok = jnp.arange(q.shape[0])
        # One segment per leading fresh row; every later token one of its own, so ids stay
        # non-decreasing (exact block skipping, masks.py) and those tokens skip the rest.
        seg = jnp.where(tok < qsl[lead], jnp.searchsorted(qsl, tok, side="right", method="compare_all") - 1, p + tok)
        mine = (tok >= qsl[0]) & (tok < qsl[lead])
        prefill = flash(q[None], k[None], v[None], segment_ids=seg[None], alibi_slopes=alibi_slopes,
                        sinks=sinks)[0]
        out += jnp.where(mine[:, None, None], prefill, jnp.zeros_like(prefill))
    # The leading fresh rows emptied: the paged kernel takes the rest.
    return out + paged(q, kv, page_table[:p], *_emptied(seq_lens[:p], qsl[:p + 1], lead), max_q=max_q)


def _decode_rows(paged, q, kv, page_table, seq_lens, qsl, *, first, decode_q):
    """Rows `first` on (decode rows, at most decode_q tokens each) through `paged`, which sees
    only their tokens: they follow the prefill rows', so a window of all they could bring
    (sliced from q's end when it would run past it) holds them. 0 for the other tokens. The rows
    before `first` are emptied, not sliced off: XLA:GPU hands a kernel a slice such as
    seq_lens[first:] as a view into its operand, and Mosaic GPU refuses a buffer that is not
    256-byte aligned (H200, 2026-11-27)."""
    n = min(q.shape[0], (page_table.shape[0] - first) * decode_q)
    if not n:
        return jnp.zeros_like(q)
    start = jnp.minimum(qsl[first], q.shape[0] - n)
    seq_lens, qsl = _emptied(seq_lens, qsl, first)
    out = paged(lax.dynamic_slice_in_dim(q, start, n), kv, page_table, seq_lens, qsl - start, max_q=decode_q)
    return lax.dynamic_update_slice_in_dim(jnp.zeros_like(q), out, start, axis=0)


def _emptied(seq_lens, qsl, n):
    """seq_lens and query_start_loc with rows [0, n) left without tokens or KV (n may be traced)."""
    rows = jnp.arange(qsl.shape[0])
    return jnp.where(rows[:-1] < n, 0, seq_lens), jnp.where(rows < n, qsl[n], qsl)


def _query_head_axis(kv_sharding, num_heads: int, num_kv_heads: int):
    """The mesh axis the query heads are split over when the pools are replicated: "model" (as
    parallel.LOGICAL_RULES splits heads) when the pools hold one KV head, which every query head
    reads, and the heads divide it; else None (more KV heads than one, replicated: the kernels see
    all query heads)."""
    size = dict(getattr(getattr(kv_sharding, "mesh", None), "shape", {})).get("model", 1)
    return "model" if num_kv_heads == 1 and size > 1 and num_heads % size == 0 else None


def _kv_head_axis(kv_sharding):
    """The mesh axis the page pools' KV heads are split over, or None (one device, heads
    replicated). kv_sharding: a NamedSharding under jit, a PartitionSpec inside shard_map
    (sequence_parallel.py), or None."""
    spec = getattr(kv_sharding, "spec", kv_sharding)
    if spec is None or getattr(kv_sharding, "is_fully_replicated", False):
        return None
    return spec[1] if len(spec) > 1 else None
