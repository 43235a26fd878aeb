"""GLM (THUDM's glm-4-9b-chat-hf: GlmForCausalLM), GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1:
Glm4ForCausalLM) and GLM-4.5 (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7: Glm4MoeForCausalLM): the Llama
module, loaded from GLM's tensors.

What differs from Llama, all from config.json: RoPE on the first `partial_rotary_factor` (0.5)
of each head, rotating adjacent pairs (rope_interleaved); q, k and v biased (`attention_bias`), the
output projection not; gate and up fused in one `gate_up_proj` ([gate; up] rows, read as two row
ranges, as Phi-3's). GLM-4 adds a norm after each branch (Gemma's sandwich norms), which it names
post_self_attn_layernorm and post_mlp_layernorm, calling the MLP's pre-norm post_attention_layernorm.

GLM-4.5 is Llama's block with GQA, RoPE on the first partial_rotary_factor of each head rotating
its two halves (transformers' Glm4Moe, unlike GLM's pairs), q/k/v biased with attention_bias, q and
k RMS-normed per head with use_qk_norm; the first `first_k_dense_replace` layers keep a dense MLP,
every later one is DeepSeek-V3's mixture of experts (models/deepseek.py: its routing and shared
experts, its tensor names). Its Hub checkpoints carry a multi-token-prediction layer past
num_hidden_layers (`model.layers.46` of GLM-4.5-Air, `.92` of GLM-4.5); it is not loaded, as
transformers does not load it. A key config.json lacks is transformers' default (GLM4_MOE_DEFAULTS).
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import deepseek, llama
from jaxserve.models.layers import rope_from_hf

# transformers' Glm4MoeConfig defaults (GLM-4.5-Air's shape) of the keys read here
GLM4_MOE_DEFAULTS = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
                         num_attention_heads=96, num_key_value_heads=8, max_position_embeddings=131072,
                         moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                         routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
                         norm_topk_prob=True, partial_rotary_factor=0.5)


def glm_config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    theta, scaling = rope_from_hf({"partial_rotary_factor": 0.5, **hf})
    bias = hf.get("attention_bias", True)
    return llama._config(hf, common, rope_theta=theta, rope_scaling=scaling, rope_interleaved=True, qkv_bias=bias,
                         o_bias=False, **family)


def glm4_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return glm_config(hf, common, sandwich_norms=True)


def glm4_moe_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    hf = {**GLM4_MOE_DEFAULTS, **hf}
    theta, scaling = rope_from_hf(hf)
    moe = deepseek.moe_fields(hf, deepseek.v3_routing(hf), bool(hf["norm_topk_prob"]),
                              tuple(range(hf["first_k_dense_replace"], hf["num_hidden_layers"])))
    return llama._config(hf, common, rope_theta=theta, rope_scaling=scaling, o_bias=False,
                         qk_norm=bool(hf.get("use_qk_norm")), **moe)


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
