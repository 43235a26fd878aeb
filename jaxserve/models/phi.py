"""Phi (Microsoft's phi-1, phi-1.5 and phi-2): the LayerNorm decoder (models/layernorm_decoder.py)
with rotary embeddings.

Phi specifics, all from config.json: RoPE on the first `partial_rotary_factor` of each head;
one LayerNorm per block feeding both attention and the MLP, whose outputs add to the block's
input (a parallel block); biases on every projection and on the untied LM head; tanh GELU
(`gelu_new`). Phi-3 is another family (models/phi3.py: Llama's module).
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name
from jaxserve.models.layers import rope_from_hf


def phi_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    if hf.get("qk_layernorm"):
        raise ValueError("Phi with qk_layernorm is not supported")
    theta, scaling = rope_from_hf({"partial_rotary_factor": 0.5, **hf})
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hidden // heads, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), qkv_bias=True, o_bias=True, mlp_bias=True,
        norm_bias=True, hidden_act=hf.get("hidden_act", "gelu_new"), parallel_residual=True,
        shared_block_norm=True, lm_head_bias=True)


PHI_NAMES = {"embedding": "weight", "o_proj": "dense", "up_proj": "fc1", "down_proj": "fc2",
             "norm": "final_layernorm"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, PHI_NAMES, "layers"), None
