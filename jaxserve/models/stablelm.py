"""StableLM (Stability AI's stablelm-3b-4e1t, StableLM 2, stable-code-3b): the LayerNorm decoder
(models/layernorm_decoder.py) with Llama's gated MLP.

StableLM specifics, all from config.json: RoPE on the first `partial_rotary_factor` (0.25) of each
head; LayerNorms with biases; q, k and v biased only with `use_qkv_bias`, the output projection and
the MLP never; a parallel block with one LayerNorm under `use_parallel_residual`, sequential
otherwise; untied embeddings by default.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_from_hf


def stablelm_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    if hf.get("qk_layernorm"):
        raise ValueError("StableLM with qk_layernorm is not supported")
    theta, scaling = rope_from_hf({"partial_rotary_factor": 0.25, **hf})
    parallel = hf.get("use_parallel_residual", False)
    return llama._config(hf, common, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=theta,
                         rope_scaling=scaling, qkv_bias=hf.get("use_qkv_bias", False), o_bias=False, mlp_bias=False,
                         norm_bias=True, gated_mlp=True, parallel_residual=parallel, shared_block_norm=parallel)
