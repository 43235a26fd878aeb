"""Memory per chip: what the weights take, how many KV pages the rest holds, and a refusal that
says what would fit when not even one full-length sequence does.

The runner sizes its pool from the chip's own memory figures (after placing the weights);
`jaxserve check` from the generation's HBM and the weights' computed size. Both go through
`kv_pool_pages`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from jaxserve import parallel
from jaxserve.checkpoint import param_shapes
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.block_manager import sequence_pages
from jaxserve.kv_cache import page_bytes_per_chip
from jaxserve.kv_groups import KVGroups

if TYPE_CHECKING:   # the draft's runner imports this module
    from jaxserve.spec_decode.draft import DraftModel

GiB = 2**30
# HBM per chip that XLA:TPU lets a program use (16, 95 and 32 GiB chips, as libtpu 0.0.42's
# compiler states it when a program does not fit), and the device_kind jax reports per generation.
TPU_HBM_GIB = {"v5e": 15.75, "v5p": 95.74, "v6e": 31.25}
TPU_DEVICE_KINDS = {"TPU v4": "v4", "TPU v5 lite": "v5e", "TPU v5": "v5p", "TPU v6 lite": "v6e"}
MAX_CHIPS = 256


class PoolDoesNotFit(ValueError):
    """Not even one max_model_len sequence's KV pages fit beside the weights."""


def _mesh(model_axis: int) -> AbstractMesh:
    return AbstractMesh((1, 1, model_axis), parallel.MESH_AXES)


def weight_bytes_per_chip(cfg: ModelConfig, dtype, model_axis: int, quantization: str | None = None,
                          lm_head: bool = False) -> int:
    """The bytes of one chip's share of the weights under tensor parallelism `model_axis`
    (quantized as `quantization`, the LM head too with `lm_head`)."""
    mesh, shapes = _mesh(model_axis), param_shapes(cfg, jnp.dtype(dtype), quantization, lm_head)

    def shard_bytes(leaf, axes):
        spec = parallel.logical_to_spec(axes, leaf.shape, mesh, cfg)
        split = math.prod(mesh.shape[a] for a in spec if a is not None)
        return math.prod(leaf.shape) * leaf.dtype.itemsize // split

    sizes = jax.tree.map(shard_bytes, shapes, parallel.param_logical_axes(shapes, cfg),
                         is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return sum(jax.tree.leaves(sizes))


def pages_per_seq(cfg: ModelConfig, ecfg: EngineConfig) -> int:
    """Pages of one sequence at the longest context the engine serves (of one KV group)."""
    return -(-(ecfg.max_model_len or cfg.max_position_embeddings) // ecfg.page_size)


def pool_pages_per_seq(cfg: ModelConfig, ecfg: EngineConfig, groups: KVGroups | None = None) -> int:
    """Pool pages one longest sequence needs: of each KV group (a sliding group: its window and a
    step's tokens, jaxserve/kv_groups.py), and the reserved NULL_PAGE of a hybrid cache."""
    if groups is None:
        return pages_per_seq(cfg, ecfg)
    return int(groups.hybrid) + sequence_pages(groups.windows, ecfg.page_size, pages_per_seq(cfg, ecfg) * ecfg.page_size,
                                               ecfg.max_num_batched_tokens)


def context_tokens(cfg: ModelConfig, ecfg: EngineConfig, groups: KVGroups, num_pages: int) -> int:
    """Tokens of the max_model_len sequences that num_pages pages hold at once (`jaxserve check`)."""
    reserved = int(groups.hybrid)
    per_seq = pool_pages_per_seq(cfg, ecfg, groups) - reserved
    return (num_pages - reserved) // per_seq * pages_per_seq(cfg, ecfg) * ecfg.page_size


def kv_pool_pages(cfg: ModelConfig, ecfg: EngineConfig, dtype, *, model_axis: int, hbm_bytes: int,
                  used_bytes: int, tpu: bool, chip: str, name: str, quantization: str | None = None,
                  groups: KVGroups | None = None, draft: DraftModel | None = None) -> int:
    """KV pages per pool: kv_memory_fraction of the HBM that `used_bytes` (the placed weights)
    leave free on each chip, a page of `groups`' group_size layers (jaxserve/kv_groups.py; None:
    every layer). draft: a draft model (speculative method draft), whose weights are placed
    after the pool is sized and whose own pool has as many pages, a page of all its layers
    (spec_decode/draft.py): its weights (held as the proposer loads them) come off the free
    memory and its page joins each page's bytes. Raises PoolDoesNotFit, naming the smallest "model" mesh size that would fit (weights
    held as `quantization`, None: as ecfg says), when that is fewer pages than one max_model_len
    sequence needs."""
    quantization = quantization or ecfg.quantization
    def pages(model_axis: int, used: int) -> int:
        free = max(hbm_bytes - used, 0)
        page_bytes = page_bytes_per_chip(cfg, dtype, ecfg.page_size, model_axis, tpu, ecfg.kv_cache_dtype, groups)
        if draft is not None:
            free = max(free - weight_bytes_per_chip(draft.cfg, dtype, model_axis, draft.quantization,
                                                    draft.quantize_lm_head), 0)
            page_bytes += page_bytes_per_chip(draft.cfg, dtype, ecfg.page_size, model_axis, tpu, ecfg.kv_cache_dtype)
        return int(free * ecfg.kv_memory_fraction) // page_bytes

    need, got = pool_pages_per_seq(cfg, ecfg, groups), pages(model_axis, used_bytes)
    if got >= need:
        return got
    what = f"{name} {jnp.dtype(dtype).name}"
    why = (f"on {model_axis} {chip} chip(s) the weights take {used_bytes / GiB:.2f} GiB of "
           f"{hbm_bytes / GiB:.2f} GiB per chip, leaving room for {got} KV pages of the {need} "
           f"that one {pages_per_seq(cfg, ecfg) * ecfg.page_size}-token sequence needs")
    wider = (m for m in (2 ** i for i in range(int(math.log2(MAX_CHIPS)) + 1)) if m > model_axis)
    fits = next((m for m in wider
                 if pages(m, weight_bytes_per_chip(cfg, dtype, m, quantization, ecfg.quantize_lm_head)) >= need), None)
    if fits is None:
        raise PoolDoesNotFit(f"{what} does not fit on up to {MAX_CHIPS} {chip} chips ({why})")
    raise PoolDoesNotFit(f"{what} needs at least {fits} {chip} chips: set mesh model: {fits} "
                         f"(or a smaller max_model_len; {why})")
