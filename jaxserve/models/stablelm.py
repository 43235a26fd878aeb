"""StableLM (Stability AI's stablelm-3b-4e1t, StableLM 2, stable-code-3b): the LayerNorm decoder
(models/layernorm_decoder.py) with Llama's gated MLP.

StableLM specifics, all from config.json: RoPE on the first `partial_rotary_factor` (0.25) of each
head; LayerNorms with biases; q, k and v biased only with `use_qkv_bias`, the output projection and
the MLP never; a parallel block with one LayerNorm under `use_parallel_residual`, sequential
otherwise; untied embeddings by default; with `qk_layernorm` (StableLM 2 12B) q and k LayerNormed
per head without biases, each head's weight a tensor of its own (`q_layernorm.norms.<head>`),
held stacked [heads, head_dim].
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import rope_from_hf


def stablelm_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    theta, scaling = rope_from_hf({"partial_rotary_factor": 0.25, **hf})
    parallel = hf.get("use_parallel_residual", False)
    return llama._config(hf, common, rms_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=theta,
                         rope_scaling=scaling, qkv_bias=hf.get("use_qkv_bias", False), o_bias=False, mlp_bias=False,
                         norm_bias=True, gated_mlp=True, parallel_residual=parallel, shared_block_norm=parallel,
                         qk_layernorm=bool(hf.get("qk_layernorm")))


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str | tuple[str, ...], None]:
    """Llama's names, but for the per-head q and k norms: one tensor a head, stacked."""
    name, rows = llama.hf_tensor(path, cfg)
    if path[-2:] in (("q_norm", "weight"), ("k_norm", "weight")):
        heads = cfg.num_heads if path[-2] == "q_norm" else cfg.num_kv_heads
        base = name.removesuffix(f"{path[-2]}.weight") + f"{path[-2][0]}_layernorm.norms"
        return tuple(f"{base}.{h}.weight" for h in range(heads)), None
    return name, rows
