"""Llama's variants that differ only in options ModelConfig already has (or NoPE layers):
Seed-OSS, Helium, ERNIE 4.5, SmolLM3 and EXAONE 4, read from their config.json as transformers
reads them (its defaults where a key is absent).

  * Seed-OSS (ByteDance): q/k/v biased (attention_bias, default on), the output projection only
    with attention_out_bias; head_dim 128 by default.
  * Helium (Kyutai): RoPE on adjacent pairs of dims (rope_interleaved); the output projection never
    biased; RMSNorm epsilon 1e-8 by default.
  * ERNIE 4.5 (Baidu, dense): RoPE on adjacent pairs; `use_bias` biases q, k, v, o and the MLP;
    tied embeddings by default.
  * SmolLM3 (Hugging Face): no RoPE on the layers `no_rope_layers` marks 0 (every fourth by
    default); a window on the layers `layer_types` calls sliding; tied embeddings by default.
  * EXAONE 4 (LG): RMSNorm on each head of q and k (Qwen3's), norms only after each branch (OLMo
    2's), no biases; with a sliding window (on the layers `layer_types` calls sliding, three of
    every four by default) the full-attention layers have no RoPE.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama


def _head_dim(hf: dict[str, Any]) -> int:
    """These families' head_dim: 128 where config.json has no key, hidden_size / heads where it is null."""
    return hf.get("head_dim", 128) or hf["hidden_size"] // hf["num_attention_heads"]


def seed_oss_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return llama._config(hf, common, head_dim=_head_dim(hf), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                         qkv_bias=hf.get("attention_bias", True), o_bias=hf.get("attention_out_bias", False))


def helium_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return llama._config(hf, common, head_dim=_head_dim(hf), rms_norm_eps=hf.get("rms_norm_eps", 1e-8),
                         rope_interleaved=True, o_bias=False)


def ernie4_5_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    bias = hf.get("use_bias", False)
    return llama._config(hf, common, head_dim=_head_dim(hf), rope_interleaved=True, qkv_bias=bias, o_bias=bias,
                         mlp_bias=bias, tie_word_embeddings=hf.get("tie_word_embeddings", True))


def smollm3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    layers, window = range(hf["num_hidden_layers"]), hf.get("sliding_window")
    rope = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0) for i in layers]
    types = hf.get("layer_types") or ["sliding_attention" if hf.get("use_sliding_window") and window and not rope[i]
                                      else "full_attention" for i in layers]
    return llama._config(hf, common, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                         tie_word_embeddings=hf.get("tie_word_embeddings", True),
                         nope_layers=tuple(i for i in layers if not rope[i]),
                         sliding_windows=llama.layer_windows(window, types))


def exaone4_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """`sliding_window_pattern` is a period (4: three windowed layers, then a global one) or, as
    LG's own configs spell it, a string of L (local) and G (global) repeated."""
    layers, window = range(hf["num_hidden_layers"]), hf.get("sliding_window", 4096)
    pattern = hf.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        pattern = ["sliding_attention" if p == "L" else "full_attention" for p in pattern]
    else:
        pattern = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
    types = hf.get("layer_types") or [pattern[i % len(pattern)] if window else "full_attention" for i in layers]
    return llama._config(hf, common, qk_norm=True, sandwich_norms=True, pre_norms=False, qkv_bias=False,
                         o_bias=False, mlp_bias=False, sliding_windows=llama.layer_windows(window, types),
                         nope_layers=tuple(i for i in layers if window and types[i] != "sliding_attention"))
