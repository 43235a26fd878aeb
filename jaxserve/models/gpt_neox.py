"""GPT-NeoX (EleutherAI's Pythia suite, GPT-NeoX-20B): the LayerNorm decoder
(models/layernorm_decoder.py) with rotary embeddings.

GPT-NeoX specifics, all from config.json: RoPE on the first `rotary_pct` of each head
(`rotary_emb_base`; transformers 5 writes both into `rope_parameters`); one `query_key_value`
projection whose rows are per head [q, k, v], as BLOOM's; exact GELU; biases everywhere (without
`attention_bias`: false); a parallel block (`use_parallel_residual`, the default) whose MLP
reads its own LayerNorm of the block's input; an untied head named `embed_out`.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name
from jaxserve.models.layers import rope_from_hf


def gpt_neox_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    # Pythia's configs name RoPE's base and fraction as GPT-NeoX's code did.
    legacy = {"rope_theta": hf.get("rotary_emb_base", 10000.0), "partial_rotary_factor": hf.get("rotary_pct", 0.25)}
    theta, scaling = rope_from_hf({**legacy, **hf})
    hidden, heads, bias = hf["hidden_size"], hf["num_attention_heads"], hf.get("attention_bias", True)
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False), qkv_bias=bias, o_bias=bias, mlp_bias=True,
        norm_bias=True, hidden_act=hf.get("hidden_act", "gelu"), qkv_interleaved=True,
        parallel_residual=hf.get("use_parallel_residual", True))


GPT_NEOX_NAMES = {"model": "gpt_neox", "embed_tokens": "embed_in", "embedding": "weight", "self_attn": "attention",
                  "qkv_proj": "query_key_value", "o_proj": "dense", "up_proj": "dense_h_to_4h",
                  "down_proj": "dense_4h_to_h", "norm": "final_layer_norm", "lm_head": "embed_out"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, GPT_NEOX_NAMES, "layers"), None
