"""gpt-oss (gpt-oss-20b, gpt-oss-120b): the Llama module (models/llama.py) with attention sinks and
a layers.SparseMoE on every layer.

Attention: q/k/v/o biased (attention_bias, on by default), YaRN RoPE, a window of `sliding_window`
on the layers `layer_types` calls sliding (every other one from the first by default), and a
learned logit per query head (`self_attn.sinks`) in each softmax. Experts: the router is biased,
its top k logits are softmaxed among themselves, and each expert's SwiGLU is clamped
(layers.clamped_swiglu, swiglu_alpha and swiglu_limit). The checkpoint fuses every layer's
experts in four tensors: `mlp.experts.gate_up_proj` [experts, hidden, 2 * width], its columns
gate, up, gate, up, ... (de-interleaved as read, so that tensor parallelism splits matching
halves), `gate_up_proj_bias` [experts, 2 * width], `down_proj` [experts, width, hidden] and
`down_proj_bias`; the weights [in, out], read transposed (registry.experts_transposed). The Hub's
checkpoints store both weights in MXFP4 (`<name>_blocks` and `_scales`, quant_method "mxfp4"),
served as stored (jaxserve/mxfp4.py; gate and up de-interleaved by rows as read).
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama, moe
from jaxserve.models.layers import rope_from_hf

# GptOssConfig's defaults, for the keys a config.json may leave out
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
THETA = 150000.0


def gpt_oss_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})} or YARN
    theta, scaling = rope_from_hf(hf, {"rope_theta": hf.get("rope_theta", THETA), **rope})
    bias = hf.get("attention_bias", True)
    return llama._config(
        hf, common, head_dim=hf.get("head_dim", 64) or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=theta, rope_scaling=scaling, qkv_bias=bias, o_bias=bias, attn_sinks=True, norm_scale_f32=True,
        sliding_windows=llama.layer_windows(hf.get("sliding_window", 128), types),
        moe_bias=True, moe_softmax_topk=True, swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        **moe._moe(hf, hf.get("num_local_experts", 128), hf["intermediate_size"], False, tuple(range(layers))))


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, moe.Interleaved | None]:
    """As Llama's, SparseMoE's router `gate` named `router`; the experts' gate and up params (and
    biases) the alternate rows of gate_up_proj (and of gate_up_proj_bias)."""
    name, _ = llama.hf_tensor(tuple("router" if p == "gate" else p for p in path), cfg)
    if path[-2] != "experts" or path[-1].startswith("down_proj"):
        return name, None
    prefix, param = name.rsplit(".", 1)
    gate = param.startswith("gate_proj")
    return f"{prefix}.gate_up_proj{param.removeprefix('gate_proj' if gate else 'up_proj')}", moe.Interleaved(0 if gate else 1)


# The MoE families' rules; the sinks split with their query heads, the experts' biases as their weights' outputs.
PARAM_AXES = {
    ("sinks",): ("heads",),
    ("gate", "bias"): ("router",),
    ("experts", "gate_proj_bias"): ("experts", "expert_mlp"),
    ("experts", "up_proj_bias"): ("experts", "expert_mlp"),
    ("experts", "down_proj_bias"): ("experts", "embed"),
    **moe.PARAM_AXES,
}
