"""The computations warm-up compiles, as pieces that `jaxserve check` (check.py) lowers the same
way for compile-only TPU devices, with ShapeDtypeStructs for the weights and the KV cache:
the model step (KV write + paged attention + logits), the sampler variants, and the multi-step
decode (decode_steps model steps and their samplers in one program).

Module-level jits with the model as a static argument: engines with the same model and shapes
share compilations within a process.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import parallel
from jaxserve.attention import AttentionMetadata
from jaxserve.buckets import StepShape, drop_lone_group
from jaxserve.config import ModelConfig
from jaxserve.lora import StepLora
from jaxserve.sampling import PenaltyCounts, sample, sampler_variants, uses_filters
from jaxserve.sampling_params import MAX_LOGPROBS

def make_step(model, cfg: ModelConfig, mesh, backend: str):
    """The step with its static arguments for `mesh`: call it as (params, kv_cache, *arrays,
    num_prefill_rows=, max_q=, decode_q=)."""
    return functools.partial(model_step, model, backend=backend, kv_sharding=parallel.kv_cache_sharding(cfg, mesh),
                             logits_sharding=parallel.logits_sharding(cfg, mesh))


def make_multi_step(model, cfg: ModelConfig, mesh, backend: str, length: int):
    """multi_step_decode with its static arguments for `mesh`: call it as (params, kv_cache,
    *arrays, row_steps, pending, last_sampled, last_run, md, steps=, filters=); `length`:
    Buckets.max_logit_rows."""
    return functools.partial(multi_step_decode, model, length=length, **make_step(model, cfg, mesh, backend).keywords)


def step_arrays(shape: StepShape, max_pages_per_seq: int, padding_slot: int, last_sampled, lora=None,
                groups: int = 1) -> tuple:
    """The step's arrays for an empty batch of `shape`, none of its tokens PENDING (see model_step);
    with `lora` (LoRA adapters' weights) its StepLora, every token on slot 0; `groups`: the page
    tables' (Buckets.empty_batch)."""
    batch = shape.empty_batch(max_pages_per_seq, padding_slot, groups)
    return *batch, np.full(shape.tokens, -1, np.int32), last_sampled, *empty_lora(shape.tokens, lora)


def empty_lora(tokens: int, lora) -> tuple:
    """() without LoRA weights, else (StepLora with each of `tokens` tokens on slot 0 (none),)."""
    return () if lora is None else (StepLora(lora, np.zeros(tokens, np.int32)),)


def multi_step_arrays(shape: StepShape, max_pages_per_seq: int, padding_slot: int, last_sampled, last_run,
                      max_model_len: int, vocab_size: int, penalties: bool, lora=None, groups: int = 1) -> tuple:
    """multi_step_decode's arrays for an empty batch of a decode `shape`: the step's, no row
    running a step or with PENDING tokens, the sampler's metadata (the plain variant's, or with
    penalties and a bias), with `lora` weights its StepLora."""
    *arrays, last_sampled = step_arrays(shape, max_pages_per_seq, padding_slot, last_sampled, groups=groups)
    md = sampler_variants(shape.logit_rows, max_model_len, vocab_size)[int(penalties)]
    none = np.zeros(shape.logit_rows, np.int32)
    return *arrays, none, none, last_sampled, last_run, md, *empty_lora(shape.tokens, lora)


def last_sampled_spec(mesh, *shape: int) -> jax.ShapeDtypeStruct:
    """The step's last_sampled argument (the previous step's sampled tokens: replicated), or a
    multi-step decode's last_run ([steps, rows])."""
    return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=parallel.replicated(mesh))


def lower_step(step, params, kv_cache, shape: StepShape, max_pages_per_seq: int, padding_slot: int, last_sampled,
               lora=None):
    """`step` (from make_step) lowered for `shape` over an empty batch; `last_sampled`: an array
    or last_sampled_spec; `lora`: LoRA adapters' weights, or None."""
    return step.func.lower(*step.args, params, kv_cache,
                           *step_arrays(shape, max_pages_per_seq, padding_slot, last_sampled, lora,
                                        table_groups(kv_cache)),
                           num_prefill_rows=shape.prefill_rows, max_q=shape.max_q, decode_q=shape.decode_q,
                           **step.keywords)


@functools.partial(jax.jit, static_argnames=("length",))
def serving_sample(logits, md, *, length: int):
    """The sampler as serving runs it: the top MAX_LOGPROBS always computed (returned when a row
    asks), and the sampled tokens also zero-padded to `length` (one shape for the next step's
    last_sampled, where it reads its PENDING tokens: model_step)."""
    out = sample(logits, md, num_logprobs=MAX_LOGPROBS)
    return out, jnp.zeros(length, jnp.int32).at[:out.tokens.shape[0]].set(out.tokens)


def sampler_args(rows: list[int], vocab_size: int, mesh, max_model_len: int) -> list[tuple[str, tuple]]:
    """(name, (logits, metadata)) of the sampler variants for each count of logit rows (a step
    shape's logit_rows; the logits: replicated)."""
    def name(r, md):
        return f"sampler-{r}{'-penalties-bias' if md.use_penalties else ''}{'-mask' if md.use_mask else ''}"
    return [(name(r, md), (jax.ShapeDtypeStruct((r, vocab_size), jnp.float32, sharding=parallel.replicated(mesh)), md))
            for r in sorted(set(rows)) for md in sampler_variants(r, max_model_len, vocab_size)]


def sampler_lowerings(rows: list[int], vocab_size: int, mesh, max_model_len: int,
                      length: int) -> list[tuple[str, Any]]:
    """(name, lower) of serving_sample's variants (sampler_args); `length`: Buckets.max_logit_rows."""
    return [(name, functools.partial(serving_sample.lower, *args, length=length))
            for name, args in sampler_args(rows, vocab_size, mesh, max_model_len)]


def empty_sequence_parallel_prefill(tokens: int, max_pages_per_seq: int, groups: int = 1, lora=None) -> tuple:
    """sequence_parallel_prefill's arrays for no token (nothing written); `groups`: table_groups;
    with `lora` (LoRA adapters' weights) its StepLora, every token on slot 0."""
    row = drop_lone_group(np.zeros((groups, max_pages_per_seq), np.int32))
    return np.zeros(tokens, np.int32), np.int32(0), np.int32(0), row, *empty_lora(tokens, lora)


def table_groups(kv_cache) -> int:
    """The leading group axis of a step's page tables and slot mappings for this cache (1: none)."""
    return 1 if kv_cache.groups is None else kv_cache.groups.num_groups


def page_copy_batches(copies, max_copies: int, num_pages: int):
    """(src, dst) page pairs as KVCache.copy_pages' fixed-size (src, dst) arrays, padded with
    copies to page num_pages (out of range: dropped)."""
    copies = np.asarray(copies, np.int32).reshape(-1, 2)
    for start in range(0, len(copies), max_copies):
        chunk = copies[start:start + max_copies]
        src = np.zeros(max_copies, np.int32)
        dst = np.full(max_copies, num_pages, np.int32)
        src[:len(chunk)], dst[:len(chunk)] = chunk[:, 0], chunk[:, 1]
        yield src, dst


@functools.partial(jax.jit, static_argnames=("model", "backend", "num_prefill_rows", "max_q", "decode_q",
                                             "kv_sharding", "logits_sharding"),
                   donate_argnames=("kv_cache",))
def model_step(model, params, kv_cache, tokens, positions, slot_mapping, page_table, seq_lens,
               query_start_loc, logits_index, token_src, last_sampled, lora=None, *, backend, num_prefill_rows, max_q,
               kv_sharding, logits_sharding, decode_q=1):
    """The arrays: packing.py's, then where PENDING tokens are: token_src[i] >= 0 makes tokens[i]
    the previous step's sampled token last_sampled[token_src[i]] (sampled on the device while
    this step was planned: see jaxserve/engine.py). `lora`: a StepLora (jaxserve/lora.py), or
    None: the program has no LoRA at all."""
    tokens = jnp.where(token_src >= 0, last_sampled[jnp.maximum(token_src, 0)], tokens)
    meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, page_table=page_table,
                             seq_lens=seq_lens, query_start_loc=query_start_loc, max_q=max_q,
                             num_prefill_rows=num_prefill_rows, decode_q=decode_q, backend=backend,
                             kv_sharding=kv_sharding, platform=parallel.platform(kv_sharding.mesh))
    variables = {"params": params} if lora is None else {"params": params, "lora": lora.variables()}
    hidden, kv_cache = model.apply(variables, tokens, positions, kv_cache, meta)
    logits = model.apply({"params": params}, hidden[logits_index], method=model.logits)
    # Under tensor parallelism: keep the lm_head matmul vocab-split, then gather the logits
    # once for the sampler (see parallel.logits_sharding). No-ops on one device.
    logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
    logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(logits_sharding.mesh))
    return logits, kv_cache, hidden   # hidden [T, H]: prompt logprobs read it, nothing else


def multi_step_variants(platform: str) -> list[tuple[bool, bool | None]]:
    """The multi-step decode's compiled variants: (penalties and a bias, its sampler's `filters`
    (sampling.sample)). On a GPU, for plain batches one without top-k/top-p and one with, neither
    with a conditional (XLA:GPU would hold the launching host at each of the loop's); for batches
    with penalties or a bias one, with the filters (right for rows without: one variant fewer).
    Elsewhere one of each, whose conditionals run on the device."""
    if platform in ("gpu", "cuda"):
        return [(False, False), (False, True), (True, True)]
    return [(False, None), (True, None)]


def multi_step_variant(variants: list[tuple[bool, bool | None]], md, vocab_size: int) -> bool | None:
    """The `filters` of the variant of `variants` (multi_step_variants) that samples md's rows (host
    arrays); the rows' filters are looked at only where the variants tell them apart (a GPU's)."""
    if (md.use_penalties, None) in variants:
        return None
    return md.use_penalties or uses_filters(md, vocab_size)


@functools.partial(jax.jit, static_argnames=("model", "backend", "steps", "filters", "length", "kv_sharding",
                                             "logits_sharding"), donate_argnames=("kv_cache",))
def multi_step_decode(model, params, kv_cache, tokens, positions, slot_mapping, page_table, seq_lens,
                      query_start_loc, logits_index, token_src, row_steps, pending, last_sampled, last_run, md,
                      lora=None, *, backend, steps, filters, length, kv_sharding, logits_sharding):
    """`steps` decode steps of a decode-only batch (packing.py's arrays: one token a row, row r
    at position r and logit row r) in one program, each step's sampled tokens the next one's
    inputs (scheduler.py: multi-step decodes). Row r runs its first row_steps[r] steps; later
    ones write nothing and their samples are dropped by the host (slot_mapping, the first step's
    slots, is recomputed from the page table like the later ones'). `md`: the plain sampler's
    arrays, or with penalties and a bias (multi_step_variants). A bias holds for every step
    (min_tokens' ban: the scheduler ends a row's run where it lifts). A penalised row's counts
    start from its history in md (its known tokens) and its `pending` tokens of the step before,
    still running when this one was planned (the last in last_sampled, the others in last_run, at
    its token_src row), and grow with each step's token. Returns the samples [steps, rows], the
    pool, each row's last sampled token padded to `length` (the next step's last_sampled, as
    serving_sample's) and the samples' tokens padded to [steps, length] (the next last_run).
    `lora`: as model_step's (a row's one token, its slot, every step)."""
    rows, page_size = tokens.shape[0], kv_cache.page_size
    no_slot = kv_cache.num_pages * page_size
    tokens = jnp.where(token_src >= 0, last_sampled[jnp.maximum(token_src, 0)], tokens)
    no_src = jnp.full_like(token_src, -1)
    counts = None
    if md.use_penalties:
        src, before = jnp.maximum(token_src, 0), jnp.arange(steps - 1)[None, :]
        counts = PenaltyCounts.of(md, model.cfg.vocab_size).add(last_run[:-1, src].T, before < pending[:, None] - 1)
        counts = counts.add(last_sampled[src][:, None], (token_src >= 0)[:, None] & (pending[:, None] > 0))

    def one(carry, k):
        kv_cache, tokens, counts = carry
        running = k < row_steps
        ahead = jnp.maximum(jnp.minimum(k, row_steps - 1), 0)   # a row past its steps stays on its last
        pos = positions + ahead
        page = page_table[..., jnp.arange(rows), pos // page_size]   # [G, rows] with KV groups
        slots = jnp.where(running, page * page_size + pos % page_size, no_slot)
        logits, kv_cache, _ = model_step(model, params, kv_cache, tokens, pos, slots, page_table, seq_lens + ahead,
                                         query_start_loc, logits_index, no_src, last_sampled, lora, backend=backend,
                                         num_prefill_rows=0, max_q=1, decode_q=1, kv_sharding=kv_sharding,
                                         logits_sharding=logits_sharding)
        out = sample(logits, md.replace(step=md.step + k), counts, num_logprobs=MAX_LOGPROBS, filters=filters)
        counts = None if counts is None else counts.add(out.tokens[:, None], running[:, None])
        return (kv_cache, jnp.where(running, out.tokens, tokens), counts), out

    (kv_cache, last, _), outs = jax.lax.scan(one, (kv_cache, tokens, counts), jnp.arange(steps))
    return (outs, kv_cache, jnp.zeros(length, jnp.int32).at[:rows].set(last),
            jnp.zeros((steps, length), jnp.int32).at[:, :rows].set(outs.tokens))
