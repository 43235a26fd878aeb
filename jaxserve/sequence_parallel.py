"""Sequence-parallel prefill: one long prompt split in equal chunks over the "seq" mesh axis.

`shard_map` is manual over "seq" only; "model" stays automatic inside, so it composes with
tensor parallelism. Each shard embeds its chunk and runs it through every layer; only the
attention needs the other chunks.

Attention uses an all-gather, not a ring: in every layer the chunks' new K/V are all-gathered
over "seq" and every shard writes the whole prompt's K/V into its copy of the paged cache
(the cache is replicated over "seq" because decoding afterwards reads all of it on every
device). The local queries then attend through the page table exactly like a plain prefill,
reaching earlier chunks and any cached prefix. A ring (ppermute of K/V blocks) would avoid
holding the full K/V per device, but the full K/V must land in every device's cache anyway,
so it would save no memory and pay n-1 dependent transfers instead of one collective.
The causal mask leaves later chunks more work than earlier ones (shard i sees i+1 chunks);
fine for the prefill lengths served here, a zigzag split would even it out.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve import parallel
from jaxserve.attention import AttentionMetadata
from jaxserve.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("model", "mesh", "backend"),
                   donate_argnames=("kv_cache",))
def sequence_parallel_prefill(model, mesh, params, kv_cache, tokens, num_tokens, num_cached,
                              page_table_row, lora=None, *, backend: str = "xla"):
    """Prefill one sequence's `num_tokens` new tokens split over the "seq" axis.

    tokens: int32[T], T a multiple of the "seq" size, real tokens first then padding;
    num_cached: tokens of this sequence already in the cache (the new ones follow them);
    page_table_row: int32[P], the sequence's pages (covering num_cached + num_tokens); with KV
    groups (jaxserve/kv_groups.py) [G, P], its pages of each group; lora: a StepLora
    (jaxserve/lora.py: the adapters' stacks, whole on every shard, and the tokens' slots [T],
    split with them), or None: the program has no LoRA.
    Returns (float32[1, vocab] logits of the last new token, updated kv_cache, the final
    hidden states [T, hidden] split over "seq": what prompt logprobs are scored from).
    """
    cfg: ModelConfig = model.cfg
    n = mesh.shape["seq"]
    t = tokens.shape[0]
    if t % n:
        raise ValueError(f"prefill length {t} is not a multiple of the seq axis size {n}")
    chunk = t // n
    num_pages, page_size = kv_cache.num_pages, kv_cache.page_size
    kv_spec = parallel.kv_cache_sharding(cfg, mesh).spec

    def shard(params, kv_cache, tokens, num_tokens, num_cached, page_table_row, lora):
        s = jax.lax.axis_index("seq")
        # Every shard writes all T tokens' K/V (gathered in attention), so it needs all slots.
        idx = jnp.arange(t)
        pos = num_cached + idx
        page = page_table_row[..., jnp.minimum(pos // page_size, page_table_row.shape[-1] - 1)]
        slots = jnp.where(idx < num_tokens, page * page_size + pos % page_size,
                          num_pages * page_size)  # out of range: padding is not written
        positions = num_cached + s * chunk + jnp.arange(chunk)
        # The queries: this chunk's real tokens (the last chunks end in padding or are all
        # padding, whose outputs are never read and come out 0), so that no shard reads the
        # pages past the prompt's last token: they hold no K/V of this sequence.
        real = jnp.clip(num_tokens - s * chunk, 0, chunk)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, page_table=page_table_row[..., None, :],
            seq_lens=(num_cached + s * chunk + real)[None],
            query_start_loc=jnp.stack([0, real]).astype(jnp.int32),
            max_q=chunk, backend=backend, seq_axis="seq", kv_sharding=kv_spec,
            platform=parallel.platform(mesh))
        variables = {"params": params} if lora is None else {"params": params, "lora": lora.variables()}
        hidden, kv_cache = model.apply(variables, tokens, positions, kv_cache, meta)
        last = num_tokens - 1
        h = jnp.where(last // chunk == s, hidden[last % chunk], 0)
        # In float32: XLA CPU's all-reduce promotion pass crashes on this bf16 psum (jax 0.10).
        return jax.lax.psum(h.astype(jnp.float32), "seq").astype(h.dtype), kv_cache, hidden

    lora_spec = P() if lora is None else type(lora)(P(), P("seq"))   # weights whole, token slots split
    h, kv_cache, hidden = jax.shard_map(
        shard, mesh=mesh, in_specs=(P(), P(), P("seq"), P(), P(), P(), lora_spec), out_specs=(P(), P(), P("seq")),
        # check_vma off: all_gather's result is typed as varying over "seq" although every shard
        # holds the same values, so the (truly replicated) cache output could not be declared P().
        axis_names={"seq"}, check_vma=False)(params, kv_cache, tokens, num_tokens, num_cached,
                                             page_table_row, lora)
    logits = model.apply({"params": params}, h[None], method=model.logits)
    # As in the runner's step: vocab-split lm_head, then one gather of the logits.
    logits = jax.lax.with_sharding_constraint(logits, parallel.logits_sharding(cfg, mesh))
    return jax.lax.with_sharding_constraint(logits, parallel.replicated(mesh)), kv_cache, hidden
