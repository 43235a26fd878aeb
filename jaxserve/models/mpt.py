"""MPT: the LayerNorm decoder (models/layernorm_decoder.py) with ALiBi, MPT's options and tensor names.

What differs from BLOOM, all from config.json: ALiBi slopes by MPT's own formula (with
`alibi_bias_max`); biases and LayerNorm biases only without `no_bias` (transformers' MPT has
none); q, k and v clamped to `clip_qkv`; exact GELU; an optional `softmax_scale`; no LayerNorm
after the embedding. `Wqkv` holds [q heads; k heads; v heads] rows, read as the row ranges of
three projections (as Phi-3's qkv_proj), so tensor parallelism splits each in whole heads.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name


def mpt_slopes(num_heads: int, alibi_bias_max: float = 8) -> tuple[float, ...]:
    """MPT's slopes (in float32): 2^(-alibi_bias_max * i / n) for i = 1..n with n the smallest
    power of two >= num_heads; with fewer heads, the odd-indexed slopes then the even ones."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / np.float32(2.0) ** (np.arange(1, n + 1, dtype=np.float32) * np.float32(alibi_bias_max / n))
    if n != num_heads:
        slopes = np.concatenate([slopes[1::2], slopes[::2]])[:num_heads]
    return tuple(float(x) for x in slopes.astype(np.float32))


def mpt_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    attn = hf.get("attn_config") or {}
    unsupported = {"attn_config.alibi=false (MPT without ALiBi)": not attn.get("alibi", True),
                   "attn_config.qk_ln": attn.get("qk_ln", False),
                   "attn_config.prefix_lm": attn.get("prefix_lm", False),
                   f"attn_config.attn_type={attn.get('attn_type')!r}":
                       attn.get("attn_type", "multihead_attention") != "multihead_attention",
                   "logit_scale": hf.get("logit_scale") is not None}
    for what, present in unsupported.items():
        if present:
            raise ValueError(f"MPT with {what} is not supported")
    hidden, heads, bias = hf["d_model"], hf["n_heads"], not hf.get("no_bias", True)
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=int(hf.get("expansion_ratio", 4) * hidden), num_layers=hf["n_layers"], num_heads=heads,
        num_kv_heads=heads, head_dim=hidden // heads, rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=hf.get("max_seq_len", 2048), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        qkv_bias=bias, o_bias=bias, mlp_bias=bias, norm_bias=bias, hidden_act="gelu",
        attn_scale=attn.get("softmax_scale"), alibi_slopes=mpt_slopes(heads, attn.get("alibi_bias_max", 8)),
        clip_qkv=attn.get("clip_qkv"))


MPT_NAMES = {"model": "transformer", "embed_tokens": "wte", "embedding": "weight", "input_layernorm": "norm_1",
             "self_attn": "attn", "o_proj": "out_proj", "post_attention_layernorm": "norm_2", "mlp": "ffn",
             "norm": "norm_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    name = hf_name(path, MPT_NAMES, "blocks")
    fused = ("q_proj", "k_proj", "v_proj")
    if len(path) < 2 or path[-2] not in fused:
        return name, None
    size = cfg.num_heads * cfg.head_dim
    start = fused.index(path[-2]) * size
    return name.replace(path[-2], "Wqkv"), (start, start + size)
