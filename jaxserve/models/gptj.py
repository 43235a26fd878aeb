"""GPT-J (EleutherAI's GPT-J-6B and its fine-tunes): the LayerNorm decoder
(models/layernorm_decoder.py) with interleaved rotary embeddings.

GPT-J specifics, all from config.json (GPT-2's names: n_embd, n_head, n_layer, n_inner,
n_positions): RoPE on the first `rotary_dim` dims of each head, rotating adjacent pairs; a
parallel block with one LayerNorm (as Phi's); q, k, v and the output projection without biases,
the MLP and the untied LM head with them; tanh GELU (`gelu_new`).
"""
from __future__ import annotations

from typing import Any

from jaxserve.config import ModelConfig
from jaxserve.models.layernorm_decoder import hf_name
from jaxserve.models.layers import rope_from_hf


def gptj_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    hidden, heads = hf["n_embd"], hf["n_head"]
    head_dim = hidden // heads
    theta, scaling = rope_from_hf({**hf, "partial_rotary_factor": (hf.get("rotary_dim") or head_dim) / head_dim})
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=hf.get("n_inner") or 4 * hidden,
        num_layers=hf["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5), rope_theta=theta, rope_scaling=scaling, rope_interleaved=True,
        max_position_embeddings=hf.get("n_positions", 2048), tie_word_embeddings=hf.get("tie_word_embeddings", False),
        mlp_bias=True, norm_bias=True, hidden_act=hf.get("activation_function", "gelu_new"), parallel_residual=True, shared_block_norm=True,
        lm_head_bias=True)


NAMES = {"model": "transformer", "embed_tokens": "wte", "embedding": "weight", "input_layernorm": "ln_1",
         "self_attn": "attn", "o_proj": "out_proj", "up_proj": "fc_in", "down_proj": "fc_out", "norm": "ln_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, NAMES, "h"), None
