"""GPT-2 and its descendant GPTBigCode (StarCoder 1, SantaCoder, the first Granite code models):
the LayerNorm decoder (models/layernorm_decoder.py) with learned positions.

Both, from config.json (n_embd, n_head, n_layer, n_inner, n_positions): a learned position table;
biases everywhere; tied embeddings; one `c_attn` projection holding [q; k; v] rows, read as three
row ranges (as MPT's Wqkv), so tensor parallelism splits each in whole heads.
  * GPT-2 stores its projections as Conv1D, weights [in, out]: the architecture is registered
    with `conv1d`, and the loader reads them transposed.
  * GPTBigCode's are Linear. Its attention is multi-query (`multi_query`, the default: one KV
    head); without it, c_attn's rows are per head [q, k, v], as BLOOM's.
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name


def _config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    """GPT-2's config.json keys as a ModelConfig; `family` adds the rest."""
    hidden, heads = hf["n_embd"], hf["n_head"]
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"], num_heads=heads, head_dim=hidden // heads,
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), max_position_embeddings=hf.get("n_positions", 1024),
        tie_word_embeddings=hf.get("tie_word_embeddings", True), qkv_bias=True, o_bias=True, mlp_bias=True,
        norm_bias=True, hidden_act=hf.get("activation_function", "gelu_new"), learned_positions=True,
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0, **family)


def gpt2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("GPT-2 with scale_attn_by_inverse_layer_idx is not supported")
    return _config(hf, common, num_kv_heads=hf["n_head"])


def gpt_bigcode_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    multi_query = hf.get("multi_query", True)
    return _config(hf, common, num_kv_heads=1 if multi_query else hf["n_head"], qkv_interleaved=not multi_query)


NAMES = {"model": "transformer", "embed_tokens": "wte", "embed_positions": "wpe", "embedding": "weight",
         "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attn": "attn", "qkv_proj": "c_attn",
         "o_proj": "c_proj", "up_proj": "c_fc", "down_proj": "c_proj", "norm": "ln_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """GPT-2's names; q, k and v as row ranges of c_attn (all but GPTBigCode's multi-head one)."""
    name = hf_name(path, NAMES, "h")
    fused = ("q_proj", "k_proj", "v_proj")
    if len(path) < 2 or path[-2] not in fused:
        return name, None
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    start, stop = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}[path[-2]]
    return name.replace(path[-2], "c_attn"), (start, stop)
