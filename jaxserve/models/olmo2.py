"""OLMo 2 (AI2): the Llama module with two of its options (ModelConfig's qk_norm_per_head, pre_norms).

What differs from Llama: q and k are RMS-normed over the whole projection (all heads together,
before the split into heads and RoPE), where Qwen3 norms each head; and the block norms only
each branch's output, before its residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`), with no norm before attention or the MLP.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama


def olmo2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return llama._config(hf, common, qk_norm=True, qk_norm_per_head=False, sandwich_norms=True, pre_norms=False)


# The q/k norms' weights span every head, so they split with their projection's rows under TP;
# Qwen3's per-head ones ([head_dim], llama.PARAM_AXES' bare "weight") stay whole.
PARAM_AXES = {("q_norm", "weight"): ("heads",), ("k_norm", "weight"): ("kv_heads",), **llama.PARAM_AXES}
