"""The decoder of the LayerNorm families: BLOOM and MPT (ALiBi), GPT-2 and GPTBigCode (learned
positions), GPT-NeoX, GPT-J, Phi, StarCoder 2, StableLM and Cohere (rotary). Each family's file
reads its config.json into the options below and names its tensors.

What they share: LayerNorm (with or without biases); Llama's attention module (llama.Attention,
whose options cover theirs), so Flax parameter names, sharding rules and kernels are Llama's.

What config.json chooses:
  * positions: ALiBi where ModelConfig.alibi_slopes is set (models/bloom.py explains it), a
    learned position embedding (`learned_positions`: GPT-2, GPTBigCode), or rotary embeddings,
    over the first rotary_fraction of each head (GPT-NeoX, Phi, StarCoder 2);
  * the block: sequential, `x + attn(ln_1(x))` then `+ mlp(ln_2(...))`; or `parallel_residual`,
    where both branches read the block's input: `x + attn(ln_1(x)) + mlp(ln_2(x))` (GPT-NeoX), or
    one LayerNorm feeding both (`shared_block_norm`: Phi);
  * q, k and v: one fused projection whose rows are per head [q, k, v] (`qkv_interleaved`: BLOOM,
    GPT-NeoX; a split in whole heads, as tensor parallelism makes, keeps each head's q, k and v
    together), or three (MPT's fused Wqkv is read as three row ranges);
  * the MLP: plain, or gated as Llama's (`gated_mlp`: StableLM, Cohere);
  * a LayerNorm after the embedding (BLOOM), q, k and v clamped (MPT), q and k LayerNormed per
    head (Command R+, StableLM 2 12B), per-layer sliding windows (StarCoder 2, Cohere 2), layers
    without RoPE (Cohere 2), an LM head bias (Phi).
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models import llama
from jaxserve.models.layers import ACTIVATIONS, GatedMLP, LayerNorm, Linear


def hf_name(path: tuple[str, ...], names: dict[str, str], layers: str) -> str:
    """A Flax param path as a checkpoint's tensor name: components renamed by `names`, the i-th
    layer `layers_i` as `<layers>.i`."""
    parts = [f"{layers}.{p.split('_', 1)[1]}" if p.startswith("layers_") else names.get(p, p) for p in path]
    return ".".join(parts)


# Megatron layout as Llama's (llama.PARAM_AXES); the fused projection splits in whole heads, and
# the per-head q and k norms' weights [heads, head_dim] (ModelConfig.qk_layernorm) with their heads.
PARAM_AXES = {("qkv_proj", "weight"): ("heads", "embed"), ("qkv_proj", "bias"): ("heads",),
              ("embed_positions", "embedding"): ("positions", "embed"),
              ("q_norm", "weight"): ("heads", "head_dim"), ("k_norm", "weight"): ("kv_heads", "head_dim"),
              **llama.PARAM_AXES, ("bias",): ("embed",)}   # LayerNorm biases


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
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, layer_kv, meta):
        c = self.cfg

        def norm(name):
            return LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype, name=name)
        attn = llama.Attention(c, self.layer, self.dtype, name="self_attn")
        if c.gated_mlp:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, ACTIVATIONS[c.hidden_act], self.dtype,
                           name="mlp")
        else:
            mlp = MLP(c, self.dtype, name="mlp")
        h = norm("input_layernorm")(x)
        out, layer_kv = attn(h, positions, layer_kv, meta)
        if not c.parallel_residual:
            x = x + out
            return x + mlp(norm("post_attention_layernorm")(x)), layer_kv
        return x + out + mlp(h if c.shared_block_norm else norm("post_attention_layernorm")(x)), layer_kv


class LayerNormDecoder(llama.LlamaModel):
    """Embeddings (+ positions' or a LayerNorm), blocks, final LayerNorm."""

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        if c.embed_norm:
            self.embed_norm = LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype)
        if c.learned_positions:
            self.embed_positions = nn.Embed(c.max_position_embeddings, c.hidden_size, dtype=self.dtype,
                                            param_dtype=self.dtype)
        self.layers = [Block(c, i, self.dtype) for i in range(c.num_layers)]
        self.norm = LayerNorm(c.rms_norm_eps, c.norm_bias, self.dtype)

    def embed(self, tokens, positions):
        x = self.embed_tokens(tokens)
        if self.cfg.learned_positions:
            x = x + self.embed_positions(positions)
        return self.embed_norm(x) if self.cfg.embed_norm else x


class LayerNormForCausalLM(llama.LlamaForCausalLM):
    body = LayerNormDecoder
