"""BLOOM, and the decoder it shares with MPT (models/mpt.py): pre-LayerNorm blocks, a plain
(not gated) GELU MLP, and ALiBi instead of rotary embeddings.

ALiBi: each query head h adds slope[h] * (key position - query position) to its scores; the
slopes come from the family's own formula (`bloom_slopes` here, mpt.mpt_slopes), computed once
into ModelConfig.alibi_slopes for all heads, and attention takes them as an array
(jaxserve.attention.attend), split with the heads under tensor parallelism.

BLOOM specifics, all from config.json: a LayerNorm right after the embedding; biases everywhere;
one `query_key_value` projection whose rows are per head [q, k, v] (so a split of its rows in
whole heads, as tensor parallelism does, keeps each head's q, k and v together); tanh GELU;
tied embeddings.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from jaxserve import attention
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache
from jaxserve.matmul import matmul_t
from jaxserve.models import llama
from jaxserve.models.layers import ACTIVATIONS, LayerNorm, Linear


def bloom_slopes(num_heads: int) -> tuple[float, ...]:
    """transformers' BLOOM slopes (in float32): 2^(-8 i / n) for i = 1..n with n the largest
    power of two <= num_heads; the heads past n take every other slope of 2n heads."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = np.float32(2.0 ** (-(2.0 ** -(math.log2(n) - 3)))) ** np.arange(1, n + 1, dtype=np.float32)
    extra = min(n, num_heads - n)
    if extra:
        base = np.float32(2.0 ** (-(2.0 ** -(math.log2(2 * n) - 3))))
        slopes = np.concatenate([slopes, base ** np.arange(1, 2 * extra, 2, dtype=np.float32)])
    return tuple(float(x) for x in slopes.astype(np.float32))


def bloom_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ValueError("BLOOM with apply_residual_connection_post_layernorm is not supported")
    hidden = hf.get("hidden_size") or hf["n_embed"]
    heads = hf.get("n_head") or hf["num_attention_heads"]
    return ModelConfig(
        **common, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=4 * hidden,
        num_layers=hf.get("n_layer") or hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        max_position_embeddings=hf.get("seq_length", 2048), tie_word_embeddings=hf.get("tie_word_embeddings", True),
        qkv_bias=True, o_bias=True, mlp_bias=True, norm_bias=True, hidden_act="gelu_pytorch_tanh",
        alibi_slopes=bloom_slopes(heads), embed_norm=True, qkv_interleaved=True)


def hf_name(path: tuple[str, ...], names: dict[str, str], layers: str) -> str:
    """A Flax param path as a checkpoint's tensor name: components renamed by `names`, the i-th
    layer `layers_i` as `<layers>.i`."""
    parts = [f"{layers}.{p.split('_', 1)[1]}" if p.startswith("layers_") else names.get(p, p) for p in path]
    return ".".join(parts)


BLOOM_NAMES = {"model": "transformer", "embed_tokens": "word_embeddings", "embedding": "weight",
               "embed_norm": "word_embeddings_layernorm", "self_attn": "self_attention",
               "qkv_proj": "query_key_value", "o_proj": "dense", "up_proj": "dense_h_to_4h",
               "down_proj": "dense_4h_to_h", "norm": "ln_f"}


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    return hf_name(path, BLOOM_NAMES, "h"), None


# Megatron layout as Llama's (llama.PARAM_AXES); the fused projection splits in whole heads.
PARAM_AXES = {("qkv_proj", "weight"): ("heads", "embed"), ("qkv_proj", "bias"): ("heads",),
              **llama.PARAM_AXES, ("bias",): ("embed",)}   # LayerNorm biases


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, layer_kv, meta):
        c = self.cfg
        dense = functools.partial(Linear, use_bias=c.qkv_bias, dtype=self.dtype)
        lead = x.shape[:-1]
        if c.qkv_interleaved:
            qkv = dense(3 * c.num_heads * c.head_dim, name="qkv_proj")(x).reshape(*lead, c.num_heads, 3, c.head_dim)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, k, v = (dense(n * c.head_dim, name=name)(x).reshape(*lead, n, c.head_dim)
                       for name, n in (("q_proj", c.num_heads), ("k_proj", c.num_kv_heads), ("v_proj", c.num_kv_heads)))
        if c.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        out, layer_kv = attention.attend(
            q, k, v, layer_kv, meta, sliding_window=None, sm_scale=c.attn_scale or 1.0 / math.sqrt(c.head_dim),
            alibi_slopes=jnp.asarray(c.alibi_slopes, jnp.float32))
        return Linear(c.hidden_size, c.o_bias, self.dtype, name="o_proj")(out.reshape(*lead, -1)), layer_kv


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        h = ACTIVATIONS[c.hidden_act](Linear(c.intermediate_size, c.mlp_bias, self.dtype, name="up_proj")(x))
        return Linear(c.hidden_size, c.mlp_bias, self.dtype, name="down_proj")(h)


class Block(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, layer_kv, meta):
        c = self.cfg

        def norm(name):
            return LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype, name=name)
        h, layer_kv = Attention(c, self.dtype, name="self_attn")(norm("input_layernorm")(x), layer_kv, meta)
        x = x + h
        return x + MLP(c, self.dtype, name="mlp")(norm("post_attention_layernorm")(x)), layer_kv


class AlibiDecoder(nn.Module):
    """Embeddings (+ LayerNorm), blocks, final LayerNorm. Positions are not used: ALiBi reads
    key positions inside attention."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        if c.embed_norm:
            self.embed_norm = LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype)
        self.layers = [Block(c, self.dtype) for _ in range(c.num_layers)]
        self.norm = LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype)

    def __call__(self, tokens, positions, kv_cache: KVCache | None = None, meta=None):
        x = self.embed_tokens(tokens)
        if self.cfg.embed_norm:
            x = self.embed_norm(x)
        new_layers = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, None if kv_cache is None else kv_cache.layers[i], meta)
            new_layers.append(kv)
        return self.norm(x), (None if kv_cache is None else KVCache(tuple(new_layers)))

    def attend_embeddings(self, hidden):   # the tied LM head, as nn.Embed.attend but through matmul_t
        return matmul_t(hidden.astype(self.dtype), self.embed_tokens.embedding)


class AlibiForCausalLM(llama.LlamaForCausalLM):
    body = AlibiDecoder
