"""GPTBigCode (StarCoder 1, SantaCoder, the first Granite code models): the LayerNorm decoder
(models/layernorm_decoder.py) with learned positions.

GPTBigCode specifics, all from config.json (GPT-2's names: n_embd, n_head, n_layer, n_inner,
n_positions): a learned position table; multi-query attention (`multi_query`, the default: one
KV head), whose `c_attn` holds [q; k; v] rows (read as three row ranges, as MPT's Wqkv), or
without it per head [q, k, v] rows as BLOOM's; biases everywhere; tied embeddings.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name
from jaxserve.models.layers import ACTIVATIONS


def gpt2_shapes(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    """The ModelConfig of GPT-2's config.json keys (GPT-2 and GPTBigCode); `family` adds the rest."""
    hidden, heads = hf["n_embd"], hf["n_head"]
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"], num_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), max_position_embeddings=hf.get("n_positions", 1024),
        tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True, o_bias=True, mlp_bias=True,
        norm_bias=True, hidden_act=act, learned_positions=True,
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0, **family)


def gpt_bigcode_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    multi_query = hf.get("multi_query", True)
    return gpt2_shapes(hf, common, num_kv_heads=1 if multi_query else hf["n_head"], qkv_interleaved=not multi_query)


NAMES = {"model": "transformer", "embed_tokens": "wte", "embed_positions": "wpe", "embedding": "weight",
         "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn": "attn", "qkv_proj": "c_attn",
         "o_proj": "c_proj", "up_proj": "c_fc", "down_proj": "c_proj", "norm": "ln_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """Names as GPT-2's; q, k and v of multi-query attention as row ranges of c_attn."""
    name = hf_name(path, NAMES, "h")
    fused = ("q_proj", "k_proj", "v_proj")
    if len(path) < 2 or path[-2] not in fused:
        return name, None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    start, stop = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}[path[-2]]
    return name.replace(path[-2], "c_attn"), (start, stop)
