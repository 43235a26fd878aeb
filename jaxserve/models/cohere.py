"""Cohere (Command R, Aya 23 and Expanse: CohereForCausalLM) and Cohere 2 (Command R7B, Command A:
Cohere2ForCausalLM): the LayerNorm decoder (models/layernorm_decoder.py) with Llama's gated MLP.

Cohere specifics, all from config.json: LayerNorms without biases; a parallel block with one
LayerNorm; RoPE rotating adjacent pairs of dims; biases only with `attention_bias`; tied
embeddings; logits multiplied by `logit_scale` (a divisor here, as Granite's logits_scaling);
with `use_qk_norm` (Command R+) q and k LayerNormed per head, a weight [heads, head_dim] each.
Cohere 2 adds a sliding window on the layers `layer_types` calls sliding (three of every four),
and only those rotate: its full-attention layers have no RoPE.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_from_hf


def cohere_config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    theta, scaling = rope_from_hf(hf)
    bias = hf.get("attention_bias", False)
    return llama._config(hf, common, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=theta,
                         rope_scaling=scaling, rope_interleaved=True, qkv_bias=bias, o_bias=bias,
                         tie_word_embeddings=hf.get("tie_word_embeddings", True),
                         logits_scaling=1.0 / hf.get("logit_scale", 0.0625), gated_mlp=True, parallel_residual=True,
                         shared_block_norm=True, qk_layernorm=bool(hf.get("use_qk_norm")), **family)


def cohere2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    layers, window = range(hf["num_hidden_layers"]), hf.get("sliding_window")
    pattern = hf.get("sliding_window_pattern", 4)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in layers]
    windows = llama.layer_windows(window, types)
    return cohere_config(hf, common, sliding_windows=windows,
                         nope_layers=tuple(i for i in layers if windows[i] is None))
