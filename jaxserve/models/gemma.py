"""Gemma 2: the Llama module with Gemma's options (ModelConfig's Gemma fields).

What differs from Llama, all set from config.json here: RMSNorm scales by (1 + weight);
embeddings are multiplied by sqrt(hidden_size); a norm after attention and one after the MLP
besides the two before them; GeGLU (tanh-approximated GELU); queries scaled by
query_pre_attn_scalar ** -0.5; tanh soft caps on attention scores and final logits; every
other layer (or as `layer_types` says) attends within a sliding window; tied embeddings.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama


def gemma2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window")
    return llama._config(
        hf, common, hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        norm_offset=1.0, scale_embeddings=True, sandwich_norms=True,
        attn_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5,
        attn_soft_cap=hf.get("attn_logit_softcapping"), final_soft_cap=hf.get("final_logit_softcapping"),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types))
