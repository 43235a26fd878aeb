"""Phi-3: the Llama module, loaded from Phi-3's fused tensors.

Phi-3 stores q, k and v in one `qkv_proj` ([q heads; k heads; v heads] rows) and gate and up in
one `gate_up_proj` ([gate; up] rows). Each is read here as the row range of the Llama
projection it holds, so the module, the sharding rules (whole heads, MLP columns) and the
kernels are Llama's: under tensor parallelism each device reads only its slice of its range.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models import llama


def phi3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return llama.mistral_config(hf, common)   # Mistral's rule: one window on every layer


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    name, _ = llama.hf_tensor(path, cfg)
    q, kv, mlp = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, q + kv),
             "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
             "gate_proj": ("gate_up_proj", 0, mlp), "up_proj": ("gate_up_proj", mlp, 2 * mlp)}
    if len(path) < 2 or path[-2] not in fused:
        return name, None
    tensor, start, stop = fused[path[-2]]
    return name.replace(path[-2], tensor), (start, stop)
