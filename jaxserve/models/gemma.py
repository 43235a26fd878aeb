"""Gemma 1, 2 and 3 (text): the Llama module with Gemma's options (ModelConfig's Gemma fields).

What differs from Llama, all set from config.json here: RMSNorm scales by (1 + weight);
embeddings are multiplied by sqrt(hidden_size); a norm after attention and one after the MLP
besides the two before them; GeGLU (tanh-approximated GELU); queries scaled by
query_pre_attn_scalar ** -0.5; tanh soft caps on attention scores and final logits; every
other layer (or as `layer_types` says) attends within a sliding window; tied embeddings.
Gemma 3 drops the attention soft cap for RMSNorms on q and k, has five windowed layers to each
global one, and gives the windowed layers their own RoPE base. Gemma 1 (and CodeGemma) has the
norms, embedding scale and GeGLU alone: no sandwich norms, soft caps or windows, queries scaled
by head_dim ** -0.5.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_by_layer_type


def gemma_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma 1's releases say hidden_act "gelu" but mean the tanh approximation (as transformers
    reads them)."""
    act = hf.get("hidden_act") or "gelu_pytorch_tanh"
    return llama._config(hf, common, hidden_act="gelu_pytorch_tanh" if act == "gelu" else act,
                         rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", True),
                         norm_offset=1.0, embedding_multiplier=hf["hidden_size"] ** 0.5)


def gemma2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return _config(hf, common, window_every=2, attn_soft_cap=hf.get("attn_logit_softcapping"))


def gemma3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """transformers 5 keeps both RoPE settings in rope_parameters by layer type; older configs
    have rope_theta / rope_scaling and rope_local_base_freq."""
    theta, scaling, local_theta = rope_by_layer_type(hf, hf.get("rope_local_base_freq", 10000.0))
    return _config(hf, common, window_every=hf.get("sliding_window_pattern", 6), qk_norm=True,
                   rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
                   attn_soft_cap=hf.get("attn_logit_softcapping"))


def gemma3_multimodal_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Gemma3ForConditionalGeneration (Gemma 3 4B and larger) serves as its language model alone:
    text in, text out (the vision tower is not loaded). Published checkpoints' `text_config` holds
    only what differs from Gemma3TextConfig's defaults: transformers' class fills in the rest."""
    from transformers import Gemma3TextConfig

    return gemma3_config(Gemma3TextConfig(**hf["text_config"]).to_dict(), common)


def multimodal_hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """The language model's tensors sit under `language_model.` in a Gemma3ForConditionalGeneration."""
    name, rows = llama.hf_tensor(path, cfg)
    return f"language_model.{name}", rows


def _config(hf: dict[str, Any], common: dict[str, Any], window_every: int, **family) -> ModelConfig:
    """What Gemma 2 and 3 share. Without `layer_types`, every `window_every`-th layer is global."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % window_every == 0 else "sliding_attention"
                                      for i in range(layers)]
    window = hf.get("sliding_window")
    return llama._config(
        hf, common, hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        norm_offset=1.0, embedding_multiplier=hf["hidden_size"] ** 0.5, sandwich_norms=True,
        attn_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5, final_soft_cap=hf.get("final_logit_softcapping"),
        sliding_windows=tuple(window if t == "sliding_attention" else None for t in types), **family)
