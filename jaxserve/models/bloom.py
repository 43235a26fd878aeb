"""BLOOM: the LayerNorm decoder (models/layernorm_decoder.py) with ALiBi, read from BLOOM's config.json.

ALiBi: each query head h adds slope[h] * (key position - query position) to its scores; the
slopes come from the family's own formula (`bloom_slopes` here, mpt.mpt_slopes), computed once
into ModelConfig.alibi_slopes for all heads, and attention takes them as an array
(jaxserve.attention.attend), split with the heads under tensor parallelism.

BLOOM specifics, all from config.json: a LayerNorm right after the embedding; biases everywhere;
one `query_key_value` projection whose rows are per head [q, k, v]; tanh GELU; tied embeddings.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name


def bloom_slopes(num_heads: int) -> tuple[float, ...]:
    """transformers' BLOOM slopes (in float32): 2^(-8 i / n) for i = 1..n with n the largest
    power of two <= num_heads; the heads past n take every other slope of 2n heads."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = np.float32(2.0 ** (-(2.0 ** -(math.log2(n) - 3)))) ** np.arange(1, n + 1, dtype=np.float32)
    extra = min(n, num_heads - n)
    if extra:
        base = np.float32(2.0 ** (-(2.0 ** -(math.log2(2 * n) - 3))))
        slopes = np.concatenate([slopes, base ** np.arange(1, 2 * extra, 2, dtype=np.float32)])
    return tuple(float(x) for x in slopes.astype(np.float32))


def bloom_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ValueError("BLOOM with apply_residual_connection_post_layernorm is not supported")
    hidden = hf.get("hidden_size") or hf["n_embed"]
    heads = hf.get("n_head") or hf["num_attention_heads"]
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=hf.get("n_layer") or hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=hf.get("seq_length", 2048), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True, hidden_act="gelu_pytorch_tanh",
        alibi_slopes=bloom_slopes(heads), embed_norm=True, qkv_interleaved=True)


BLOOM_NAMES = {"model": "transformer", "embed_tokens": "word_embeddings", "embedding": "weight",
               "embed_norm": "word_embeddings_layernorm", "self_attn": "self_attention",
               "qkv_proj": "query_key_value", "o_proj": "dense", "up_proj": "dense_h_to_4h",
               "down_proj": "dense_4h_to_h", "norm": "ln_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, BLOOM_NAMES, "h"), None
