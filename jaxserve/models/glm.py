"""GLM (THUDM's glm-4-9b-chat-hf: GlmForCausalLM) and GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1:
Glm4ForCausalLM): the Llama module, loaded from GLM's tensors.

What differs from Llama, all from config.json: RoPE on the first `partial_rotary_factor` (0.5)
of each head, rotating adjacent pairs (rope_interleaved); q, k and v biased (`attention_bias`), the
output projection not; gate and up fused in one `gate_up_proj` ([gate; up] rows, read as two row
ranges, as Phi-3's). GLM-4 adds a norm after each branch (Gemma's sandwich norms), which it names
post_self_attn_layernorm and post_mlp_layernorm, calling the MLP's pre-norm post_attention_layernorm.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_from_hf


def glm_config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    theta, scaling = rope_from_hf({"partial_rotary_factor": 0.5, **hf})
    bias = hf.get("attention_bias", True)
    return llama._config(hf, common, rope_theta=theta, rope_scaling=scaling, rope_interleaved=True, qkv_bias=bias,
                         o_bias=False, **family)


def glm4_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return glm_config(hf, common, sandwich_norms=True)


# GLM-4's names of Gemma's four norms (llama.DecoderLayer's names are Gemma's).
GLM4_NORMS = {"post_attention_layernorm": "post_self_attn_layernorm",
              "pre_feedforward_layernorm": "post_attention_layernorm",
              "post_feedforward_layernorm": "post_mlp_layernorm"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    if cfg.sandwich_norms:
        path = tuple(GLM4_NORMS.get(p, p) for p in path)
    name, _ = llama.hf_tensor(path, cfg)
    if len(path) < 2 or path[-2] not in ("gate_proj", "up_proj"):
        return name, None
    size = cfg.intermediate_size
    start = 0 if path[-2] == "gate_proj" else size
    return name.replace(path[-2], "gate_up_proj"), (start, start + size)
