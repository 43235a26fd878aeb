"""Mixture-of-experts families: Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), Qwen2-MoE (Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B: Qwen3-MoE's experts beside a gated shared expert), Mixtral (8x7B, 8x22B) and OLMoE
(OLMoE-1B-7B: OLMo 2's whole-projection q/k norms, with pre-norms).

All are the Llama module (models/llama.py) with a layers.SparseMoE in place of the dense MLP of
their MoE layers. Their checkpoints hold one tensor per expert, as on the Hub and as
transformers 5's save_pretrained writes them (it fuses the experts only in memory):
`mlp.experts.E.{gate,up,down}_proj.weight` (Qwen3-MoE, Qwen2-MoE, OLMoE) and
`block_sparse_moe.experts.E.w1/w3/w2.weight` (Mixtral: w1 gate, w3 up, w2 down); `hf_tensor` names each stacked [experts, ...] param's tensors
in expert order. Tensor parallelism splits each expert's intermediate dim (every device holds
1/TP of every expert; with expert parallelism, whole experts: 1/TP of them) and the shared expert's
as a dense MLP's; the router and the shared expert's gate are replicated.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama, olmo2


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """Where a stacked expert param lies in a fused HF tensor whose rows alternate between params
    (in jaxserve's layout: axis 1, each expert's output rows or bias entries): the rows `index`,
    `index + parts`, ... (gpt-oss's gate_up_proj: gate, up, gate, up, ...). registry.hf_tensor's rows."""
    index: int
    parts: int = 2


MIXTRAL_NAMES = {"mlp": "block_sparse_moe", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


# transformers' Qwen2MoeConfig defaults (Qwen1.5-MoE-A2.7B's shape) of the keys read here
QWEN2_MOE_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                          num_attention_heads=16, max_position_embeddings=32768, rms_norm_eps=1e-6,
                          max_window_layers=28, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                          num_experts_per_tok=4, num_experts=60, qkv_bias=True)


def qwen3_moe_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen3 attention (q/k norms; with use_sliding_window one window on every layer, as
    transformers' Qwen3-MoE); Qwen's MoE layers (_qwen_moe)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return dataclasses.replace(llama.qwen3_config(hf, common), sliding_windows=(window,) * hf["num_hidden_layers"],
                               **_qwen_moe(hf))


def qwen2_moe_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen2 attention: q/k/v biased with qkv_bias (its default), o never; with use_sliding_window a
    window on the layers `layer_types` calls sliding (without it, transformers' rule: the even ones
    of the first max_window_layers). Qwen's MoE layers (_qwen_moe), each with a shared expert, a
    gated MLP of shared_expert_intermediate_size whose output is scaled by sigmoid(shared_expert_gate(x))."""
    hf = {**QWEN2_MOE_DEFAULTS, **hf}
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 and i < hf["max_window_layers"]
                                      else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return llama._config(hf, common, qkv_bias=bool(hf["qkv_bias"]), o_bias=False,
                         sliding_windows=llama.layer_windows(window, types), **_qwen_moe(hf),
                         moe_shared_intermediate_size=hf["shared_expert_intermediate_size"], moe_shared_gate=True)


def mixtral_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Mistral attention; every layer's MLP is experts of intermediate_size, top-k renormalized."""
    return dataclasses.replace(llama.mistral_config(hf, common), **_moe(
        hf, hf["num_local_experts"], hf["intermediate_size"], True, tuple(range(hf["num_hidden_layers"]))))


def olmoe_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Llama's block with q and k RMS-normed over their whole projections; every layer's MLP is
    experts of intermediate_size, renormalized only with norm_topk_prob."""
    if hf.get("clip_qkv") is not None:
        raise ValueError("OLMoE with clip_qkv is not supported")
    return dataclasses.replace(
        llama._config(hf, common, qk_norm=True, qk_norm_per_head=False),
        **_moe(hf, hf.get("num_experts", hf.get("num_local_experts")), hf["intermediate_size"],
               hf.get("norm_topk_prob", False), tuple(range(hf["num_hidden_layers"]))))


def _qwen_moe(hf: dict[str, Any]) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's experts: MoE layers every `decoder_sparse_step`-th, but those in
    `mlp_only_layers`, which keep a dense MLP of intermediate_size; renormalized with norm_topk_prob."""
    layers = hf["num_hidden_layers"]
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    experts = hf.get("num_experts", hf.get("num_local_experts"))   # transformers 5 writes the latter
    return _moe(hf, experts, hf["moe_intermediate_size"], hf.get("norm_topk_prob", False),
                tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0))


def _moe(hf: dict[str, Any], experts: int, width: int, renormalize: bool, layers: tuple[int, ...]) -> dict:
    top_k = hf["num_experts_per_tok"]
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {experts}] (the number of experts), got {top_k}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                norm_topk_prob=bool(renormalize), moe_layers=layers)


def qwen3_moe_hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str | tuple[str, ...], None]:
    """As Llama's; a stacked expert param (`.../mlp/experts/gate_proj`) -> its experts' tensors."""
    name, _ = llama.hf_tensor(path, cfg)
    if len(path) < 2 or path[-2] != "experts":
        return name, None
    prefix = name.rsplit(".", 1)[0]
    return tuple(f"{prefix}.{e}.{path[-1]}.weight" for e in range(cfg.num_experts)), None


def qwen2_moe_hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str | tuple[str, ...], None]:
    """Qwen3-MoE's names; the shared MLP (SparseMoE's `shared_experts`) is `shared_expert`."""
    return qwen3_moe_hf_tensor(tuple("shared_expert" if p == "shared_experts" else p for p in path), cfg)


def mixtral_hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str | tuple[str, ...], None]:
    """Qwen3-MoE's names with Mixtral's module names (every Mixtral MLP is experts)."""
    return qwen3_moe_hf_tensor(tuple(MIXTRAL_NAMES.get(p, p) for p in path), cfg)


# Llama's rules, and the experts' stacked weights split as a dense MLP's, each expert alike (or,
# with expert parallelism, by expert: parallel.EXPERT_PARALLEL_RULES).
PARAM_AXES = {
    ("experts", "gate_proj"): ("experts", "expert_mlp", "embed"),
    ("experts", "up_proj"): ("experts", "expert_mlp", "embed"),
    ("experts", "down_proj"): ("experts", "embed", "expert_mlp"),
    ("gate", "weight"): ("router", "embed"),
    **llama.PARAM_AXES,
}
OLMOE_PARAM_AXES = {**olmo2.QK_NORM_AXES, **PARAM_AXES}   # OLMo 2's split q/k norms
# The shared expert's gate: a router of one output, replicated as the router.
QWEN2_MOE_PARAM_AXES = {("shared_expert_gate", "weight"): ("router", "embed"), **PARAM_AXES}
