"""DeepSeek-V2 and V3: DeepSeek-V2, V2-Lite, V2.5 (DeepseekV2ForCausalLM); DeepSeek-V3, R1 and the
models built on V3's architecture, Kimi K2 and Moonlight (DeepseekV3ForCausalLM).

The Llama module (models/llama.py) with multi-head latent attention (models/mla.py: served from a
latent KV cache of one KV head of kv_lora_rank + qk_rope_head_dim dims) and DeepSeek's mixture of
experts: the first `first_k_dense_replace` layers keep a dense MLP of intermediate_size, then
every `moe_layer_freq`-th layer (all, in every release) holds `n_routed_experts` experts of
moe_intermediate_size and `n_shared_experts` shared ones, one dense MLP of n_shared_experts *
moe_intermediate_size (`mlp.shared_experts`) every token takes. Routing (models/routing.py):
  * V3: sigmoid scores, `e_score_correction_bias` added only to choose, the experts in `n_group`
    groups of which each token keeps the `topk_group` whose two best scores sum highest, the
    chosen scores renormalized with norm_topk_prob;
  * V2: softmax scores, `topk_method` "greedy" or "group_limited_greedy" (groups by their best
    score); never renormalized (transformers' V2 router ignores norm_topk_prob);
  * both: the weights times `routed_scaling_factor`, the router in float32.
RoPE on qk_rope_head_dim dims, in adjacent pairs (V2 always; V3 with rope_interleave, its
default), YaRN's attention scale on cos and sin, and the softmax scale (qk_nope + qk_rope)^-0.5
times mscale(factor, mscale_all_dim)^2 when the YaRN config has mscale_all_dim. The latent norms
(q_a_layernorm, kv_a_layernorm) have eps 1e-6 whatever rms_norm_eps says, as in transformers.

config.json leaves out what equals transformers' defaults (save_pretrained writes the difference):
each version's are read for the keys it lacks. Tensors are named as transformers 5 writes them
(per-expert, as Qwen2-MoE's: `mlp.experts.E.gate_proj.weight`); the multi-token-prediction layer
of V3's Hub checkpoint (`model.layers.61`) is not loaded, as transformers does not.
"""
from __future__ import annotations

import math
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama, moe
from jaxserve.models.layers import rope_from_hf
from jaxserve.models.mla import LatentDims
from jaxserve.models.routing import Routing

# transformers' DeepseekV3Config / DeepseekV2Config defaults of the keys read here
V3_DEFAULTS = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                   num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                   v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                   first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                   rope_interleave=True)
V2_DEFAULTS = dict(vocab_size=102400, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, first_k_dense_replace=0,
                   kv_lora_rank=512, q_lora_rank=1536, n_group=None, n_routed_experts=64, n_shared_experts=2,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0, topk_group=None,
                   topk_method="greedy", v_head_dim=128, moe_intermediate_size=1407)


def deepseek_v3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    hf = {**V3_DEFAULTS, **hf}
    return _config(hf, common, v3_routing(hf), bool(hf["norm_topk_prob"]), bool(hf["rope_interleave"]))


def v3_routing(hf: dict[str, Any]) -> Routing:
    """V3's routing (GLM-4.5's too): sigmoid scores, the selection bias, groups scored by their two best."""
    return Routing(sigmoid=True, selection_bias=True, groups=hf["n_group"] or 1, topk_groups=hf["topk_group"] or 1,
                   group_top=2, scale=float(hf["routed_scaling_factor"]))


def deepseek_v2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    hf = {**V2_DEFAULTS, **hf}
    scale = float(hf["routed_scaling_factor"])
    if hf["topk_method"] == "greedy":
        routing = Routing(scale=scale)
    elif hf["topk_method"] == "group_limited_greedy":
        routing = Routing(groups=hf["n_group"], topk_groups=hf["topk_group"], scale=scale)
    else:
        raise ValueError(f"DeepSeek-V2 topk_method {hf['topk_method']!r} is not supported "
                         "(supported: greedy, group_limited_greedy)")
    if hf.get("mlp_bias"):
        raise ValueError("DeepSeek-V2 with mlp_bias is not supported")
    return _config(hf, common, routing, False, True)


def _config(hf: dict[str, Any], common: dict[str, Any], routing: Routing, renormalize: bool,
            interleaved: bool) -> ModelConfig:
    """What V2 and V3 share: latent attention, the softmax scale, the dense and MoE layers."""
    dims = LatentDims(hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"],
                      hf["q_lora_rank"] or 0)
    theta, scaling = rope_from_hf(hf)
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    sm_scale = (dims.qk_nope_head_dim + dims.qk_rope_head_dim) ** -0.5
    if scaling.kind != "default" and rope.get("mscale_all_dim") and scaling.factor > 1:
        sm_scale *= (0.1 * rope["mscale_all_dim"] * math.log(scaling.factor) + 1.0) ** 2
    freq = hf.get("moe_layer_freq", 1)
    moe_layers = tuple(i for i in range(hf["first_k_dense_replace"], hf["num_hidden_layers"]) if i % freq == 0)
    return llama._config(hf, common, num_kv_heads=1, head_dim=dims.kv_lora_rank + dims.qk_rope_head_dim,
                         rope_theta=theta, rope_scaling=scaling, rope_interleaved=interleaved, attn_scale=sm_scale,
                         mlp_bias=False, mla=dims,
                         **(moe_fields(hf, routing, renormalize, moe_layers) if hf["n_routed_experts"] else {}))


def moe_fields(hf: dict[str, Any], routing: Routing, renormalize: bool, layers: tuple[int, ...]) -> dict:
    """DeepSeek's mixture of experts on `layers` (GLM-4.5's too): n_routed_experts of
    moe_intermediate_size chosen by `routing`, and n_shared_experts shared ones, one MLP."""
    experts, width = hf["n_routed_experts"], hf["moe_intermediate_size"]
    if experts % routing.groups:
        raise ValueError(f"n_group {routing.groups} does not divide the {experts} routed experts")
    return dict(moe._moe(hf, experts, width, renormalize, layers), moe_routing=routing,
                moe_shared_intermediate_size=(hf.get("n_shared_experts") or 0) * width)


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str | tuple[str, ...], None]:
    """Qwen3-MoE's names; the selection bias (a SparseMoE param) is the router's, `mlp.gate.e_score_correction_bias`."""
    if path[-1] == "e_score_correction_bias":
        path = (*path[:-1], "gate", path[-1])
    return moe.qwen3_moe_hf_tensor(path, cfg)


# The MoE families' rules; the query heads' projections split by head, the latent ones replicated.
PARAM_AXES = {
    ("q_a_proj", "weight"): ("latent", "embed"),
    ("q_a_proj", "bias"): ("latent",),
    ("q_b_proj", "weight"): ("heads", "latent"),
    ("kv_a_proj_with_mqa", "weight"): ("latent", "embed"),
    ("kv_a_proj_with_mqa", "bias"): ("latent",),
    ("kv_b_proj", "weight"): ("heads", "latent"),
    ("e_score_correction_bias",): ("router",),
    **moe.PARAM_AXES,
}
