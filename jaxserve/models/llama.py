"""One Flax implementation of the Llama family: Llama 2/3, Mistral, Qwen2.

The families differ only in configuration (see ModelConfig.from_hf_dict): RoPE scaling,
GQA/MQA head counts, per-layer sliding windows, q/k/v biases, tied embeddings.
Parameter names and shapes follow Hugging Face's (`model.layers_3.self_attn.q_proj.weight` is
`model.layers.3.self_attn.q_proj.weight`, [out, in]), so loading is a rename.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import attention
from jaxserve.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = cfg.rope_scaling
    if sc.kind == "linear":
        inv_freq = inv_freq / sc.factor
    elif sc.kind == "llama3":
        old_len = sc.original_max_position_embeddings
        low_wavelen = old_len / sc.low_freq_factor
        high_wavelen = old_len / sc.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
        smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
        smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x [..., T, H, D] with positions [..., T]; HF's rotate-half convention, computed in float32."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, D/2]
    cos = jnp.cos(freqs)[..., None, :]
    sin = jnp.sin(freqs)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Linear(nn.Module):
    """x @ weight.T (+ bias), weight stored [out, in] as in PyTorch. Besides loading without a
    transpose, contracting the weight's contiguous last dim makes XLA CPU's decode steps 7-15%
    faster at 1-16 rows (benchmarks/results/roofline_cpu.md); accelerators take either layout."""
    features: int
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2),
                       (self.features, x.shape[-1]), self.dtype)
        y = jax.lax.dot_general(x.astype(self.dtype), w, (((x.ndim - 1,), (1,)), ((), ())))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return w * xf.astype(self.dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, kv_cache, meta):
        c = self.cfg
        dense = functools.partial(Linear, dtype=self.dtype)
        q = dense(c.num_heads * c.head_dim, c.qkv_bias, name="q_proj")(x)
        k = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, name="k_proj")(x)
        v = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, name="v_proj")(x)
        lead = x.shape[:-1]
        q = q.reshape(*lead, c.num_heads, c.head_dim)
        k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
        v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        inv_freq = jnp.asarray(rope_inv_freq(c))
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out, kv_cache = attention.attend(
            q, k, v, kv_cache, meta, sliding_window=c.sliding_windows[self.layer],
            sm_scale=1.0 / math.sqrt(c.head_dim))
        out = dense(c.hidden_size, c.o_bias, name="o_proj")(out.reshape(*lead, -1))
        return out, kv_cache


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = functools.partial(Linear, use_bias=c.mlp_bias, dtype=self.dtype)
        h = nn.silu(dense(c.intermediate_size, name="gate_proj")(x)) * dense(c.intermediate_size, name="up_proj")(x)
        return dense(c.hidden_size, name="down_proj")(h)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, kv_cache, meta):
        eps = self.cfg.rms_norm_eps
        h, kv_cache = Attention(self.cfg, self.layer, self.dtype, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), positions, kv_cache, meta)
        x = x + h
        x = x + MLP(self.cfg, self.dtype, name="mlp")(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))
        return x, kv_cache


class LlamaModel(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, i, self.dtype) for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)

    def __call__(self, tokens, positions, kv_caches=None, meta=None):
        x = self.embed_tokens(tokens)
        new_caches = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, None if kv_caches is None else kv_caches[i], meta)
            new_caches.append(kv)
        return self.norm(x), (None if kv_caches is None else new_caches)

    def attend_embeddings(self, hidden):
        return self.embed_tokens.attend(hidden)


class LlamaForCausalLM(nn.Module):
    """tokens/positions: [B, T] without a KV cache, or flat [T] with paged `kv_caches` and `meta`.

    Returns final hidden states and the updated caches; `logits` projects chosen hidden states."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.model = LlamaModel(self.cfg, self.dtype)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = Linear(self.cfg.vocab_size, False, self.dtype)

    def __call__(self, tokens, positions, kv_caches=None, meta=None):
        return self.model(tokens, positions, kv_caches, meta)

    def logits(self, hidden):
        if self.cfg.tie_word_embeddings:
            out = self.model.attend_embeddings(hidden)
        else:
            out = self.lm_head(hidden)
        return out.astype(jnp.float32)

    def forward_logits(self, tokens, positions):
        """Full-sequence logits without a cache (training, scoring)."""
        hidden, _ = self.model(tokens, positions)
        return self.logits(hidden)
