"""The Llama family: Llama 2/3, Mistral, Ministral, Qwen2, Qwen3, Granite (and Phi-3, Gemma, OLMo 2 and 3, GLM and
the llama_variants), in one Flax implementation.

The architectures differ only in configuration, read here from their config.json: RoPE
scaling, GQA/MQA head counts, per-layer sliding windows, q/k/v biases, tied embeddings,
q/k norms, layers without RoPE (NoPE), attention sinks (gpt-oss) and a head_dim that is not
hidden_size / heads (Qwen3).
Parameter names and shapes follow Hugging Face's (`model.layers_3.self_attn.q_proj.weight` is
`model.layers.3.self_attn.q_proj.weight`, [out, in]), so loading is a rename (`hf_tensor`).
The attention module serves the LayerNorm decoder too (models/layernorm_decoder.py): fused per-head
q/k/v rows, clamped q/k/v, ALiBi and learned positions are its options for those families.
"""
from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxserve import attention
from jaxserve.config import ModelConfig
from jaxserve.kv_cache import KVCache
from jaxserve.matmul import matmul_t
from jaxserve.models.layers import (ACTIVATIONS, GatedMLP, LayerNorm, Linear, RMSNorm, SparseMoE, apply_rope,
                                    experts_product, rope_frequencies, rope_from_hf)
from jaxserve.models.mla import LatentAttention


def _config(hf: dict[str, Any], common: dict[str, Any], **family) -> ModelConfig:
    """The keys Llama, Mistral and Qwen2 share; `family` overrides what differs."""
    heads = hf["num_attention_heads"]
    theta, scaling = rope_from_hf(hf)
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=hf.get("attention_bias", False),
        o_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        hidden_act=hf.get("hidden_act", "silu"),
    )
    fields.update(family)
    return ModelConfig(**common, **fields)


def llama_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return _config(hf, common)


def granite_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """IBM Granite 3: Llama with four constants, on the embeddings, the branches' outputs, the
    attention scores (in place of 1/sqrt(head_dim)) and the logits (a divisor)."""
    return _config(hf, common, embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
                   attn_scale=float(hf.get("attention_multiplier", 1.0)),
                   logits_scaling=float(hf.get("logits_scaling", 1.0)))


def mistral_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """One sliding window (when set) on every layer; Phi-3's configs say the same."""
    window = hf.get("sliding_window")
    return _config(hf, common, sliding_windows=(window,) * hf["num_hidden_layers"] if window else ())


def ministral_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Ministral (8B): Mistral with its window on the layers `layer_types` calls sliding (all of
    them by default); never a bias (transformers' Ministral ignores attention_bias)."""
    types = hf.get("layer_types") or ["sliding_attention"] * hf["num_hidden_layers"]
    return _config(hf, common, qkv_bias=False, o_bias=False, mlp_bias=False,
                   sliding_windows=layer_windows(hf.get("sliding_window", 4096), types))


def layer_windows(window: int | None, layer_types: list[str]) -> tuple[int | None, ...]:
    """Per-layer windows: `window` on the "sliding_attention" layers of a config's layer_types."""
    return tuple(window if t == "sliding_attention" and window else None for t in layer_types)


def qwen2_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen2 always has q/k/v biases and never an o bias."""
    return _config(hf, common, qkv_bias=True, o_bias=False, sliding_windows=_qwen_windows(hf))


def qwen3_config(hf: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen3: Qwen2's windows, biases only with attention_bias, RMSNorm on q and k heads."""
    return _config(hf, common, qk_norm=True, sliding_windows=_qwen_windows(hf))


def _qwen_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen's sliding window, when on, spares the first `max_window_layers` layers (or follows
    `layer_types` where the config lists them)."""
    layers, window = hf["num_hidden_layers"], hf.get("sliding_window")
    if not (hf.get("use_sliding_window", False) and window):
        return ()
    if hf.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in hf["layer_types"])
    first = hf.get("max_window_layers", layers)
    return tuple(None if i < first else window for i in range(layers))


def hf_tensor(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, tuple[int, int] | None]:
    """Flax param path -> (Hugging Face tensor name, None: the whole tensor). Flax names the
    i-th layer `layers_i`."""
    parts = []
    for p in path:
        if p.startswith("layers_"):
            parts += ["layers", p.split("_", 1)[1]]
        else:
            parts.append(p)
    parts[-1] = {"embedding": "weight"}.get(parts[-1], parts[-1])
    return ".".join(parts), None


# Param path suffix -> logical axes (parallel.LOGICAL_RULES). Megatron layout: q/k/v, gate and up
# split over their outputs, o and down over their inputs; Linear weights are [out, in]. The first
# matching suffix wins, so the norms' bare "weight" comes last.
PARAM_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "weight"): ("vocab", "embed"),
    ("lm_head", "bias"): ("vocab",),
    ("q_proj", "weight"): ("heads", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "weight"): ("kv_heads", "embed"),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "weight"): ("kv_heads", "embed"),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "weight"): ("embed", "heads"),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "weight"): ("mlp", "embed"),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "weight"): ("mlp", "embed"),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "weight"): ("embed", "mlp"),
    ("down_proj", "bias"): ("embed",),
    ("weight",): ("embed",),  # RMSNorm scales
}


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, layer_kv, meta):
        c = self.cfg
        dense = functools.partial(Linear, dtype=self.dtype)
        lead = x.shape[:-1]
        if c.qkv_interleaved:   # BLOOM, GPT-NeoX: one projection, its rows per head [q, k, v]
            qkv = dense(3 * c.num_heads * c.head_dim, c.qkv_bias, name="qkv_proj")(x)
            q, k, v = (qkv.reshape(*lead, c.num_heads, 3, c.head_dim)[..., i, :].reshape(*lead, -1) for i in range(3))
        else:
            q = dense(c.num_heads * c.head_dim, c.qkv_bias, name="q_proj")(x)
            k = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, name="k_proj")(x)
            v = dense(c.num_kv_heads * c.head_dim, c.qkv_bias, name="v_proj")(x)
        if c.clip_qkv is not None:   # MPT
            q, k, v = (jnp.clip(t, -c.clip_qkv, c.clip_qkv) for t in (q, k, v))

        def qk_norm(q, k):
            return (RMSNorm(c.rms_norm_eps, self.dtype, c.norm_offset, c.norm_scale_f32, name=name)(a)
                    for name, a in (("q_norm", q), ("k_norm", k)))
        if c.qk_norm and not c.qk_norm_per_head:   # OLMo 2: over all heads at once (under TP a split axis)
            q, k = qk_norm(q, k)
        q = q.reshape(*lead, c.num_heads, c.head_dim)
        k = k.reshape(*lead, c.num_kv_heads, c.head_dim)
        v = v.reshape(*lead, c.num_kv_heads, c.head_dim)
        if c.qk_norm and c.qk_norm_per_head:   # Qwen3, Gemma 3
            q, k = qk_norm(q, k)
        if c.qk_layernorm:   # Command R+, StableLM 2 12B
            q, k = (LayerNorm(c.rms_norm_eps, False, self.dtype, per_head=True, name=name)(a)
                    for name, a in (("q_norm", q), ("k_norm", k)))
        # Positions: ALiBi (BLOOM, MPT), a learned table added to the embeddings (GPT-2), none on
        # NoPE layers (SmolLM3, EXAONE 4, Cohere 2), else RoPE.
        alibi = None if c.alibi_slopes is None else jnp.asarray(c.alibi_slopes, jnp.float32)
        if alibi is None and not c.learned_positions and self.layer not in c.nope_layers:
            inv_freq, scale = rope_frequencies(c, local=c.sliding_windows[self.layer] is not None)
            q, k = (apply_rope(x, positions, jnp.asarray(inv_freq), scale, c.rope_interleaved) for x in (q, k))
        sinks = self.param("sinks", nn.initializers.zeros, (c.num_heads,), self.dtype) if c.attn_sinks else None
        out, layer_kv = attention.attend(
            q, k, v, layer_kv, meta, sliding_window=c.sliding_windows[self.layer],
            sm_scale=c.attn_scale or 1.0 / math.sqrt(c.head_dim), soft_cap=c.attn_soft_cap, alibi_slopes=alibi,
            sinks=sinks)
        out = dense(c.hidden_size, c.o_bias, name="o_proj")(out.reshape(*lead, -1))
        return out, layer_kv


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, layer_kv, meta):
        c = self.cfg

        def norm(name):
            return RMSNorm(c.rms_norm_eps, self.dtype, c.norm_offset, c.norm_scale_f32, name=name)

        def pre_norm(name, x):   # OLMo 2 has none
            return norm(name)(x) if c.pre_norms else x
        attn = Attention if c.mla is None else LatentAttention   # DeepSeek's (models/mla.py)
        h, layer_kv = attn(c, self.layer, self.dtype, name="self_attn")(
            pre_norm("input_layernorm", x), positions, layer_kv, meta)
        if self.layer in c.moe_layers:   # models/moe.py, gpt_oss.py, deepseek.py, glm.py
            mesh = getattr(meta and meta.kv_sharding, "mesh", None)   # None inside sequence-parallel shard_map
            mlp = SparseMoE(c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                            experts_product(c), self.dtype, mesh, c.moe_bias, c.moe_softmax_topk, c.moe_routing,
                            c.moe_shared_intermediate_size, ACTIVATIONS[c.hidden_act], c.moe_shared_gate,
                            expert_parallel=c.expert_parallel, name="mlp")
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, ACTIVATIONS[c.hidden_act], self.dtype,
                           name="mlp")
        if c.sandwich_norms:   # Gemma: each branch's output normed too (HF names these four); OLMo 2: only those
            x = x + norm("post_attention_layernorm")(h)
            return x + norm("post_feedforward_layernorm")(mlp(pre_norm("pre_feedforward_layernorm", x))), layer_kv
        x = x + self.residual(h)
        return x + self.residual(mlp(norm("post_attention_layernorm")(x))), layer_kv

    def residual(self, h):   # Granite scales each branch's output
        return h if self.cfg.residual_multiplier == 1.0 else h * jnp.asarray(self.cfg.residual_multiplier, h.dtype)


class LlamaModel(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        c = self.cfg
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype,
                                     param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, i, self.dtype) for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype, c.norm_offset, c.norm_scale_f32)

    def embed(self, tokens, positions):
        x = self.embed_tokens(tokens)
        if self.cfg.embedding_multiplier != 1.0:   # rounded to the model dtype, as HF does
            x = x * jnp.asarray(self.cfg.embedding_multiplier, self.dtype)
        return x

    def __call__(self, tokens, positions, kv_cache: KVCache | None = None, meta=None):
        x = self.embed(tokens, positions)
        if kv_cache is None:
            for layer in self.layers:
                x, _ = layer(x, positions, None, meta)
            return self.norm(x), None
        entries = list(kv_cache.layers)
        for i, layer in enumerate(self.layers):
            e, group = kv_cache.layer(i)   # the hybrid cache: its pool entry and page table (kv_cache.py)
            x, entries[e] = layer(x, positions, entries[e], meta if group is None else meta.group(group))
        return self.norm(x), kv_cache.replace(layers=tuple(entries))

    def attend_embeddings(self, hidden):   # the tied LM head, as nn.Embed.attend but through matmul_t
        return matmul_t(hidden.astype(self.dtype), self.embed_tokens.embedding)


class LlamaForCausalLM(nn.Module):
    """tokens/positions: [B, T] without a KV cache, or flat [T] with the paged `kv_cache` (a KVCache) and `meta`.

    Returns final hidden states and the updated cache; `logits` projects chosen hidden states.
    Other families subclass it with their own `body` (models/layernorm_decoder.py)."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    body = LlamaModel   # the decoder stack: embeddings to final norm, with `attend_embeddings`

    def setup(self):
        self.model = self.body(self.cfg, self.dtype)
        # Tied models have params for it only when quantized (quantization.tied_head).
        self.lm_head = Linear(self.cfg.vocab_size, self.cfg.lm_head_bias, self.dtype)

    def __call__(self, tokens, positions, kv_cache: KVCache | None = None, meta=None):
        return self.model(tokens, positions, kv_cache, meta)

    def logits(self, hidden):
        if self.cfg.tie_word_embeddings and not self.has_variable("params", "lm_head"):
            out = self.model.attend_embeddings(hidden)
        else:
            out = self.lm_head(hidden)
        out = out.astype(jnp.float32)
        if self.cfg.logits_scaling != 1.0:   # Granite
            out = out / self.cfg.logits_scaling
        if self.cfg.final_soft_cap is not None:
            out = self.cfg.final_soft_cap * jnp.tanh(out / self.cfg.final_soft_cap)
        return out

    def forward_logits(self, tokens, positions):
        """Full-sequence logits without a cache (training, scoring)."""
        hidden, _ = self.model(tokens, positions)
        return self.logits(hidden)
