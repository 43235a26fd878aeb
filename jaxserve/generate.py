"""Reference generation: one static batch, prefill then greedy decode, contiguous KV cache.

Each sequence owns one contiguous cache row: a single page of size max_len (the KV layout of
jaxserve/kv_cache.py), so nothing is shared, chunked or scheduled. It is the baseline the parity tests
use and the engine must beat.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.attention import AttentionMetadata
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache, LayerKV
from jaxserve.models import build_model


def contiguous_kv_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32):
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(tuple(LayerKV(jnp.zeros(shape, dtype), None if cfg.values_are_keys else jnp.zeros(shape, dtype))
                         for _ in range(cfg.num_layers)))


@functools.partial(jax.jit, static_argnames=("model", "max_q"), donate_argnames=("kv",))
def _step(model, params, kv, tokens, positions, seq_lens, query_start_loc, last_index, *, max_q):
    batch, max_len = kv.num_pages, kv.page_size
    seq_of_token = jnp.searchsorted(query_start_loc[1:], jnp.arange(tokens.shape[0]), side="right",
                                    method="compare_all")
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=seq_of_token * max_len + positions,
        page_table=jnp.arange(batch, dtype=jnp.int32)[:, None],
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        max_q=max_q,
    )
    hidden, kv = model.apply({"params": params}, tokens, positions, kv, meta)
    logits = model.apply({"params": params}, hidden[last_index], method=model.logits)
    return logits, kv


def greedy_generate(cfg: ModelConfig, params, prompts: list[list[int]], max_new_tokens: int,
                    dtype=jnp.float32, return_logits: bool = False):
    """Greedy continuations of `prompts` (no early stop). With return_logits, also the
    [max_new_tokens, vocab] logits that chose each token, per prompt."""
    model = build_model(cfg, dtype)
    lens = np.array([len(p) for p in prompts], np.int32)
    max_len = int(lens.max()) + max_new_tokens
    kv = contiguous_kv_cache(cfg, len(prompts), max_len, dtype)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = np.concatenate(prompts).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    logits, kv = _step(model, params, kv, tokens, positions, lens, qsl, qsl[1:] - 1,
                       max_q=int(lens.max()))
    outs, all_logits = [], []
    decode_qsl = np.arange(len(prompts) + 1, dtype=np.int32)
    for i in range(max_new_tokens):
        all_logits.append(np.asarray(logits))
        nxt = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)
        outs.append(nxt)
        if i == max_new_tokens - 1:
            break
        positions = lens + i
        logits, kv = _step(model, params, kv, nxt, positions, positions + 1, decode_qsl,
                           decode_qsl[:-1], max_q=1)
    tokens_out = np.stack(outs, axis=1).tolist()
    if return_logits:
        return tokens_out, np.stack(all_logits, axis=1)
    return tokens_out
