"""DeepSeek's multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi K2), served from a latent KV cache.

MLA keys and values are one shared latent per token: c_kv, the RMS-normed first kv_lora_rank dims
of `kv_a_proj_with_mqa`, plus k_rope, its last qk_rope_head_dim dims rotated (one key head shared
by all query heads). transformers expands the latent through `kv_b_proj` into per-head keys
[k_nope (W_UK c_kv), k_rope] and values (W_UV c_kv) before attending. Here it is never expanded:
W_UK is absorbed into the queries and W_UV applied after the weighted sum, so attention is
multi-query attention over the latent itself:

  * the cache holds, per token, ONE KV head of kv_lora_rank + qk_rope_head_dim dims (576 for
    V3): [c_kv, k_rope], which is both the key and the value, so it is stored once, in the K
    pool (ModelConfig.values_are_keys: no V pool), and every attention path (XLA, the Pallas
    kernels, quantized KV, prefix caching) reads the values from the K pages; the family's
    ModelConfig says num_kv_heads 1 and that head_dim, its `mla` the sizes;
  * each query head is [q_nope W_UK, q_rope] (kv_lora_rank + qk_rope_head_dim dims), so its
    score with a token is q_nope . k_nope + q_rope . k_rope, transformers' score; scaled by
    the original head's (qk_nope + qk_rope)^-0.5 (times YaRN's mscale^2: the config's attn_scale);
  * the output's first kv_lora_rank dims are sum_j p_j c_kv_j; W_UV takes them to the head's
    v_head_dim values (the last qk_rope_head_dim dims are discarded), then o_proj.

The dense path without a cache is the same computation. Under tensor parallelism the query heads
(q_b_proj / q_proj, kv_b_proj, o_proj) split over "model"; the latent projections and the one KV
head are replicated (parallel.kv_cache_sharding replicates KV heads that do not divide the axis).
Parameters are named as transformers' modules, so loading is Llama's rename.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax.numpy as jnp

from jaxserve import attention, quantization
from jaxserve.config import ModelConfig
from jaxserve.models.layers import Linear, RMSNorm, apply_rope, rope_frequencies

LATENT_NORM_EPS = 1e-6   # q_a_layernorm's and kv_a_layernorm's: transformers gives them no other


@dataclasses.dataclass(frozen=True)
class LatentDims:
    """MLA's sizes (ModelConfig.mla), named as DeepSeek's config.json names them."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0   # 0: q_proj straight from the hidden state (V2-Lite)


class Weight(nn.Module):
    """A Linear's `weight` [out, in], returned rather than applied (kv_b_proj is used in parts).
    Quantized (`--quantization`, an FP8 checkpoint's block scales) it stays so in memory and is
    dequantized whole in the step: one small matrix a layer (V3's 16M weights, 32 MiB in bf16)."""
    shape: tuple[int, int]
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        if self.has_variable("params", "qweight"):
            return quantization.dequantize(self.get_variable("params", "qweight"), self.get_variable("params", "scale"),
                                           self.dtype, zero=self.get_variable("params", quantization.ZERO))
        return self.param("weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2), self.shape, self.dtype)


class LatentAttention(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, layer_kv, meta):
        c, m = self.cfg, self.cfg.mla
        dense = functools.partial(Linear, dtype=self.dtype)
        lead, heads, rank = x.shape[:-1], c.num_heads, m.kv_lora_rank
        nope, rope, v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        if m.q_lora_rank:   # V2, V3: queries through their own low-rank bottleneck
            q = dense(m.q_lora_rank, c.qkv_bias, name="q_a_proj")(x)
            q = RMSNorm(LATENT_NORM_EPS, self.dtype, name="q_a_layernorm")(q)
            q = dense(heads * (nope + rope), False, name="q_b_proj")(q)
        else:   # V2-Lite
            q = dense(heads * (nope + rope), False, name="q_proj")(x)
        q = q.reshape(*lead, heads, nope + rope)
        latent = dense(rank + rope, c.qkv_bias, name="kv_a_proj_with_mqa")(x)
        c_kv = RMSNorm(LATENT_NORM_EPS, self.dtype, name="kv_a_layernorm")(latent[..., :rank])
        inv_freq, scale = rope_frequencies(dataclasses.replace(c, head_dim=rope))
        q_rope, k_rope = (apply_rope(t, positions, jnp.asarray(inv_freq), scale, c.rope_interleaved)
                          for t in (q[..., nope:], latent[..., None, rank:]))
        w_kv = Weight((heads * (nope + v_dim), rank), self.dtype, name="kv_b_proj")().reshape(heads, nope + v_dim, rank)
        q = jnp.concatenate([jnp.einsum("...hn,hnr->...hr", q[..., :nope], w_kv[:, :nope]), q_rope], axis=-1)
        kv = jnp.concatenate([c_kv[..., None, :], k_rope], axis=-1)   # one KV head: [c_kv, k_rope]
        out, layer_kv = attention.attend(q, kv, kv, layer_kv, meta, sliding_window=None, sm_scale=c.attn_scale)
        out = jnp.einsum("...hr,hvr->...hv", out[..., :rank], w_kv[:, nope:])
        return dense(c.hidden_size, c.o_bias, name="o_proj")(out.reshape(*lead, heads * v_dim)), layer_kv
