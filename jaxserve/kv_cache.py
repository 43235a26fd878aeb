"""KVCache: the serving KV cache on the device, every layer's K and V pages in one pytree.

Layout (shared by every attention kernel, described here only): per layer, K and V each
[num_pages, num_kv_heads, page_size, head_dim]. Heads come before page slots so that one KV head
of one page is a contiguous [page_size, head_dim] slab: whole (8, 128) tiles on TPU, which its
page DMAs require (a head picked out of [page_size, num_kv_heads, head_dim] slices a tiled
dimension, and Mosaic refuses). A token's slot is page * page_size + offset (slot_mapping); a
sequence's pages are a row of the page table. Sharded over KV heads (parallel.kv_cache_sharding,
axis 1). On TPU head_dim is stored padded to whole 128 lanes (`pool_head_dim`; attention pads
q/k/v to it and cuts the output back).

Latent attention (DeepSeek, models/mla.py) attends with values equal to its keys: its cache holds
K alone (`ModelConfig.values_are_keys`; LayerKV.v and v_scale None), and every attention path
reads the values from the K pages (pallas_kernels/paged_attention: v_pages None), which halves
both the pool and the bytes a step reads.

Quantized caches (`kv_cache_dtype` int8 or fp8, e4m3): K and V are stored in that dtype with one
float32 scale per (page slot, KV head), k_scale / v_scale [num_pages, num_kv_heads, 1, lanes]:
slot s of a page's KV head h is [page, h, 0, s]; lanes is page_size, on TPU rounded up to whole
128 (`scale_lanes`; the lanes past page_size are never read). Why this shape: Mosaic takes a
kernel's operands row-major with (rows, 128) tiles, and XLA:TPU keeps a [N, KVH, page_size] f32
pool with the page index along lanes when page_size < 128, so it copied each whole scale pool
into padded tiles before every kernel call (4x its size at page_size 32); a [.., 1, 128k] pool
XLA keeps row-major in (1, 128) tiles at rest, and one (page, KV head) is one tile row, one DMA
(benchmarks/results/kv_quantization.md). KV heads on axis 1, as in the pages: the scales shard
with them. Each token's head vector is scaled so its largest magnitude is the dtype's largest
value, which keeps outliers of one token from costing the precision of the others. The XLA path
and the TPU kernel read the pools as they are and apply the scales to the scores (K) and to the
weights (V); the GPU kernel dequantizes each K/V tile in shared memory once its copy is in. A
dequantized copy of the cache is never made. Scales add 4 bytes per head_dim values (on TPU,
512 bytes per page and KV head below page_size 128).

The cache is one argument of the jitted step, donated and updated in place: a layer writes its
new K/V with `LayerKV.write` and the step returns the new cache. With KV groups (the hybrid cache
of sliding-window models, jaxserve/kv_groups.py) it holds group_size entries, not one per layer:
layer l uses entry `layer(l)[0]` through its group's page table (the step's page_table and
slot_mapping then have a leading group axis), and a page id names that page in every entry. Which page holds what is the
block manager's business (jaxserve/block_manager.py); this module holds the arrays, their size
in pages and bytes, and the whole-page operations (copy-on-write copies, poisoning).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from jaxserve import parallel
from jaxserve.config import ModelConfig
from jaxserve.kv_groups import KVGroups
from jaxserve.quantization import quantize_rows


KV_CACHE_DTYPES = {"auto": None, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def storage_dtype(kv_cache_dtype: str, model_dtype):
    """The dtype the pools hold: the model's for "auto", else int8 or float8_e4m3fn."""
    return jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype)


@struct.dataclass
class LayerKV:
    """One layer's page pools (and, quantized, their scales)."""
    k: jax.Array   # [num_pages, num_kv_heads, page_size, head_dim]
    v: jax.Array | None   # like k; None: the values are the keys (values_are_keys), read from k
    k_scale: jax.Array | None = None   # float32 [num_pages, num_kv_heads, 1, lanes]; None: not quantized
    v_scale: jax.Array | None = None   # None also when v is

    def write(self, k, v, slot_mapping, platform: str = "cpu") -> tuple["LayerKV", tuple[jax.Array, jax.Array]]:
        """Scatter new K/V [T, KVH, D] into their slots; out-of-range slots (padding) are dropped.
        Returns the updated pools and the new K/V as the pools give them back: in the pools'
        dtype, or for quantized pools stored * scale in k's dtype (what a kernel that takes
        this step's K/V directly, the flash path, must see to agree with the pages). Without a
        V pool (the values are the keys) v is not written, and k is given back for both.
        platform: of the pools' devices; on TPU 1-byte pools are written in whole pages."""
        ps = self.k.shape[2]
        # Indexed as (page, offset), not through a flat reshape: for T = 1 XLA CPU turns the flat
        # form into a dynamic-update-slice that copies the whole pool several times per step.
        page, offset = slot_mapping // ps, slot_mapping % ps
        scatter = _put_rows if platform != "tpu" else _put_whole_pages if self.k.dtype.itemsize == 1 else _put_heads

        def put(pages, scales, x):
            """(pages, scales) with x [T, KVH, D] written, and x as they give it back."""
            if scales is None:
                x = x.astype(pages.dtype)
                return scatter(pages, x, page, offset), None, x
            stored, scale = quantize_rows(x, pages.dtype)
            return (scatter(pages, stored, page, offset), scales.at[page, :, 0, offset].set(scale, mode="drop"),
                    _dequantize(stored, scale, x.dtype))

        k_pages, k_scale, k = put(self.k, self.k_scale, k)
        if self.v is None:
            return LayerKV(k_pages, None, k_scale), (k, k)
        v_pages, v_scale, v = put(self.v, self.v_scale, v)
        return LayerKV(k_pages, v_pages, k_scale, v_scale), (k, v)

    def constrain(self, sharding) -> "LayerKV":
        """Re-assert the pools' sharding (after the write: left alone, XLA may reshard the cache
        to suit the attention math, which costs a cache all-gather)."""
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), self)


@struct.dataclass
class KVCache:
    layers: tuple[LayerKV, ...]   # one per model layer, or with KV groups one per group entry
    # The hybrid cache's map of layers to entries and page tables (jaxserve/kv_groups.py); None:
    # one entry per layer, one page table (static: a program is traced for its layout).
    groups: KVGroups | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def spec(cls, cfg: ModelConfig, mesh, num_pages: int, page_size: int, dtype,
             kv_cache_dtype: str = "auto", groups: KVGroups | None = None) -> "KVCache":
        """The cache as ShapeDtypeStructs with their shardings (to lower a step without memory).
        dtype: the model's; kv_cache_dtype: "auto" (the model's), "int8" or "fp8"; groups: its
        KV groups (None or one full group: a pool entry per layer)."""
        platform = parallel.platform(mesh)
        sharding = parallel.kv_cache_sharding(cfg, mesh)   # scales too: KV heads on axis 1
        shape = (num_pages, cfg.num_kv_heads, page_size, pool_head_dim(cfg.head_dim, platform))
        pool = jax.ShapeDtypeStruct(shape, storage_dtype(kv_cache_dtype, dtype), sharding=sharding)
        scale = None
        if kv_cache_dtype != "auto":
            scale_shape = (num_pages, cfg.num_kv_heads, 1, scale_lanes(page_size, platform))
            scale = jax.ShapeDtypeStruct(scale_shape, jnp.float32, sharding=sharding)
        groups = groups if groups is not None and groups.num_groups > 1 else None
        entries = cfg.num_layers if groups is None else groups.group_size
        v_pool, v_scale = (None, None) if cfg.values_are_keys else (pool, scale)
        return cls(tuple(LayerKV(pool, v_pool, scale, v_scale) for _ in range(entries)), groups)

    @classmethod
    def zeros(cls, cfg: ModelConfig, mesh, num_pages: int, page_size: int, dtype,
              kv_cache_dtype: str = "auto", groups: KVGroups | None = None) -> "KVCache":
        """A zeroed cache (scales of 1), each array created on its devices already sharded."""
        def filled(x, value):
            return None if x is None else _filler(x.shape, x.dtype, value, x.sharding)()

        spec = cls.spec(cfg, mesh, num_pages, page_size, dtype, kv_cache_dtype, groups)
        return cls(tuple(LayerKV(filled(x.k, 0), filled(x.v, 0), filled(x.k_scale, 1), filled(x.v_scale, 1))
                         for x in spec.layers), spec.groups)

    def layer(self, i: int) -> tuple[int, int | None]:
        """Model layer i's pool entry, and its group's index into the step's page tables and slot
        mappings (None: they have no group axis)."""
        return (i, None) if self.groups is None else (self.groups.layer_entry[i], self.groups.layer_group[i])

    @property
    def num_pages(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def page_size(self) -> int:
        return self.layers[0].k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (all devices together, without any TPU tile padding)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def abstract(self) -> "KVCache":
        """The same cache as ShapeDtypeStructs (lowering with it donates nothing)."""
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self)

    @functools.partial(jax.jit, donate_argnums=0)
    def copy_pages(self, src, dst) -> "KVCache":
        """Page dst[i] takes page src[i]'s K/V in every layer (copy-on-write); dst out of range: no-op.
        The cache is donated: use the returned one."""
        return jax.tree.map(lambda x: x.at[dst].set(x[src], mode="drop"), self)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill_pages(self, pages, value) -> "KVCache":
        """Every listed page takes `value` in K and V of every layer; pages out of range: no-op.
        The cache is donated: use the returned one."""
        return jax.tree.map(lambda x: x.at[pages].set(value.astype(x.dtype), mode="drop"), self)


@functools.cache
def _filler(shape, dtype, value, sharding):
    """A jit making one array full of `value`, created sharded: one per kind of array, so every
    layer's pools share a compilation (one each, at ~0.1 s apiece on a CPU, was 1 s of a start)."""
    return jax.jit(lambda: jnp.full(shape, value, dtype), out_shardings=sharding)


def _put_rows(pages, x, page, offset):
    """pages[page[t], :, offset[t]] = x[t]; pages out of range (padding) are dropped."""
    return pages.at[page, :, offset].set(x, mode="drop")


def _put_heads(pages, x, page, offset):
    """_put_rows for a TPU pool, a [head_dim] row per token and KV head. Written a [KVH, head_dim]
    window per token, XLA:TPU wants the pool with KV heads minor to slots, which the kernels'
    operands (row-major) are not: free to choose between two steps of one program (a multi-step
    decode), it copied every pool into that layout and back (2 copies per pool and step). As
    fast as _put_rows in a single step (XLA:TPU's estimate); slower on a CPU (2-5x at 64-512 tokens)."""
    heads = jnp.arange(x.shape[1])[None, :]
    return pages.at[page[:, None], heads, offset[:, None]].set(x, mode="drop")


def _put_whole_pages(pages, x, page, offset):
    """_put_rows for a TPU pool of 1-byte values, written a whole page at a time. XLA:TPU stores
    int8 and fp8 in (32, 128) tiles with four slots packed in each 32-bit word, and does not
    write one slot's row in place: it copies the whole pool into another layout and back (2 pool
    copies per write, 4-6 per layer; benchmarks/results/kv_quantization.md). A page of 32
    slots is whole tiles, which it scatters in place. Each token takes a copy of its page, the
    new rows are merged into the copy of the page's first token, and every token writes that
    copy back: tokens sharing a page write the same bytes, so their order does not matter."""
    num_pages, tokens = pages.shape[0], x.shape[0]
    in_pool = page < num_pages   # padding points past the pool
    page_in_pool = jnp.minimum(page, num_pages - 1)
    # T x T compares, not a scatter-min into a num_pages-long array: v6e offloads that scatter to
    # its SparseCore, whose code generator once overflowed its stack compiling it.
    first = jnp.argmax(page[:, None] == page[None, :], axis=1)
    first = jnp.where(in_pool, first, tokens)   # padding's row is merged nowhere
    merged = pages[page_in_pool].at[first, :, offset].set(x, mode="drop")
    return pages.at[page].set(merged[jnp.minimum(first, tokens - 1)], mode="drop")


def _dequantize(stored, scale, dtype):
    """quantize_rows's (stored [T, KVH, D], scale [T, KVH]) back to values in `dtype`."""
    return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


def pool_head_dim(head_dim: int, platform: str) -> int:
    """The head_dim a page pool stores. On TPU, whole 128-lane tiles: for a smaller head_dim XLA
    lays the pool out with the page index innermost, and every page read then relayouts the
    whole pool (measured: 24-48 whole-pool copies per step of the embedded model, head_dim 32).
    The padding costs memory (4x at head_dim 32, 2x at 64), which `page_bytes_per_chip` counts."""
    return _whole_tpu_lanes(head_dim, platform)


def scale_lanes(page_size: int, platform: str) -> int:
    """The lanes of a scale pool's last axis (one page's scales of one KV head). On TPU whole
    128-lane tiles, for the reason pool_head_dim gives (the module docstring has the numbers)."""
    return _whole_tpu_lanes(page_size, platform)


def _whole_tpu_lanes(n: int, platform: str) -> int:
    return -(-n // 128) * 128 if platform == "tpu" else n


def page_bytes_per_chip(cfg: ModelConfig, dtype, page_size: int, model_axis: int, tpu: bool,
                        kv_cache_dtype: str = "auto", groups: KVGroups | None = None) -> int:
    """K and V of one page in every layer (K alone when the values are the keys; with KV groups:
    in a group's group_size layers; with their scales when quantized), on one chip (KV
    heads split over "model" when they divide). On TPU the pool's two minor dims (page slots,
    head_dim) are stored in whole (sublanes, 128 lanes) tiles, so a head_dim of 32 takes 128
    lanes, and a page's scales of one KV head whole 128 lanes (scale_lanes)."""
    itemsize = storage_dtype(kv_cache_dtype, dtype).itemsize
    platform = "tpu" if tpu else "cpu"
    slots, dim = page_size, pool_head_dim(cfg.head_dim, platform)
    if tpu:
        slots = -(-slots // (32 // itemsize)) * (32 // itemsize)
    per_head = slots * dim * itemsize + (4 * scale_lanes(page_size, platform) if kv_cache_dtype != "auto" else 0)
    mesh = jax.sharding.AbstractMesh((1, 1, model_axis), parallel.MESH_AXES)
    split = model_axis if "model" in parallel.kv_cache_sharding(cfg, mesh).spec else 1
    layers = cfg.num_layers if groups is None else groups.group_size
    return cfg.kv_pools * layers * cfg.num_kv_heads * per_head // split
