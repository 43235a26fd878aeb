"""StarCoder 2: the LayerNorm decoder (models/layernorm_decoder.py) with rotary embeddings.

StarCoder 2 specifics, all from config.json: grouped-query attention; RoPE on whole heads;
biases on every projection (`use_bias`); tanh GELU; a sliding window on every layer when set;
tied embeddings by default; its LayerNorms' epsilon is `norm_epsilon`.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name
from jaxserve.models.layers import rope_from_hf


def starcoder2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    theta, scaling = rope_from_hf(hf)
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    bias, window = hf.get("use_bias", True), hf.get("sliding_window")
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
        num_layers=layers, num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hidden // heads, rms_norm_eps=hf.get("norm_epsilon", 1e-5), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        norm_bias=True, hidden_act=hf.get("hidden_act", "gelu_pytorch_tanh"),
        sliding_windows=(window,) * layers if window else ())


STARCODER2_NAMES = {"embedding": "weight", "up_proj": "c_fc", "down_proj": "c_proj"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, STARCODER2_NAMES, "layers"), None
