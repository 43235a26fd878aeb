"""OLMo 2 and OLMo 3 (AI2): the Llama module with two of its options (ModelConfig's qk_norm_per_head, pre_norms).

What differs from Llama: q and k are RMS-normed over the whole projection (all heads together,
before the split into heads and RoPE), where Qwen3 norms each head; and the block norms only
each branch's output, before its residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`), with no norm before attention or the MLP.
OLMo 3 adds a sliding window on the layers `layer_types` calls sliding (three of every four by
default), whose RoPE is never scaled (the full-attention layers' may be: YaRN).
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_by_layer_type


def olmo2_config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    return llama._config(hf, common, qk_norm=True, qk_norm_per_head=False, sandwich_norms=True, pre_norms=False,
                         norm_scale_f32=True,
                         **family)


def olmo3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                                      for i in range(hf["num_hidden_layers"])]
    theta, scaling, local_theta = rope_by_layer_type({"rope_theta": 500000.0, **hf})   # OLMo 3's default base
    return olmo2_config(hf, common, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                        sliding_windows=llama.layer_windows(hf.get("sliding_window", 4096), types))


# The q/k norms' weights span every head, so they split with their projection's rows under TP;
# Qwen3's per-head ones ([head_dim], llama.PARAM_AXES' bare "weight") stay whole.
QK_NORM_AXES = {("q_norm", "weight"): ("heads",), ("k_norm", "weight"): ("kv_heads",)}
PARAM_AXES = {**QK_NORM_AXES, **llama.PARAM_AXES}
