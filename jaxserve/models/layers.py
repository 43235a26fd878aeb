"""Layers shared by the model families: Linear, RMSNorm, LayerNorm, rotary embeddings, the gated MLP
and its mixture of experts.

Parameter names and layouts follow Hugging Face's (a Linear weight is [out, in], a norm scale is
`weight`), so a family whose modules are named as its HF modules loads by renaming alone.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxserve import lora, quantization
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.matmul import matmul_t
from jaxserve.models.experts import (Experts, every_expert, grouped_experts, in_chunks, routed_within, split_specs,
                                     splits)
from jaxserve.models.routing import Routing, route

ROPE_KINDS = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
# HF `hidden_act` / `hidden_activation` names of the MLPs' activations.
ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
               "gelu_new": functools.partial(nn.gelu, approximate=True),   # the same tanh formula (Phi)
               "gelu": functools.partial(nn.gelu, approximate=False)}


class Linear(nn.Module):
    """x @ weight.T (+ bias), weight stored [out, in] as in PyTorch. Besides loading without a
    transpose, contracting the weight's contiguous last dim makes XLA CPU's decode steps 7-15%
    faster at 1-16 rows (benchmarks/results/roofline_cpu.md), more with `matmul_t`'s product by
    columns; accelerators take either layout.

    Every projection of every family goes through this class, so quantized weights belong here:
    params holding `qweight` and a scale instead of `weight` (jaxserve.quantization.quantize_params)
    are multiplied by quantization.matmul, which dequantizes inside the fused computation. LoRA
    adapters (the "lora" collection, jaxserve/lora.py) add each token's own product."""
    features: int
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        if self.has_variable("params", "qweight"):
            w8a8 = self.has_variable("params", quantization.SCALES["w8a8"])
            y = quantization.matmul(x, self.get_variable("params", "qweight"),
                                    self.get_variable("params", quantization.SCALES["w8a8" if w8a8 else "int8"]),
                                    self.dtype, int8_activations=w8a8, zero=self.get_variable("params", quantization.ZERO))
        else:
            w = self.param("weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2),
                           (self.features, x.shape[-1]), self.dtype)
            y = matmul_t(x.astype(self.dtype), w)
        if self.has_variable("lora", "a"):
            y = y + lora.delta(x.astype(self.dtype), *(self.get_variable("lora", k) for k in ("a", "b", "mask")))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32
    # Gemma stores the scale minus one (offset 1.0).
    offset: float = 0.0
    # Rounding as each family's transformers implementation does: Llama casts the normed input to
    # the dtype, then multiplies by the weight in it (two roundings); with scale_f32 the product is
    # taken in float32 and cast once (gpt-oss, OLMo 2 and 3: ModelConfig.norm_scale_f32; Gemma,
    # whose offset is added in float32).
    scale_f32: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        w = self.param("weight", init, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset or self.scale_f32:
            return (xf * (self.offset + w.astype(jnp.float32))).astype(self.dtype)
        return w * xf.astype(self.dtype)


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last axis, computed in float32 (BLOOM, MPT). With per_head, a
    weight for each head of x [..., heads, head_dim] (Cohere's and StableLM's q and k norms)."""
    eps: float
    use_bias: bool
    dtype: jnp.dtype = jnp.float32
    per_head: bool = False

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, x.shape[-2 if self.per_head else -1:], self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * w.astype(jnp.float32)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype).astype(jnp.float32)
        return y.astype(self.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with the default activation."""
    hidden_size: int
    intermediate_size: int
    use_bias: bool
    activation: Callable[[Any], Any] = nn.silu
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return Linear(features, self.use_bias, self.dtype, name=name)
        h = self.activation(dense(self.intermediate_size, "gate_proj")(x)) * \
            dense(self.intermediate_size, "up_proj")(x)
        return dense(self.hidden_size, "down_proj")(h)


def gated(activation: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """The experts' product of the gate and up projections: act(gate) * up (SwiGLU with silu)."""
    return lambda gate, up: activation(gate) * up


def clamped_swiglu(gate, up, alpha: float, limit: float):
    """gpt-oss's product: the gate clamped above at `limit`, the up projection to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * gate * jax.nn.sigmoid(alpha * gate)


def experts_product(cfg: ModelConfig) -> Callable[[Any, Any], Any]:
    """A family's experts' (gate, up) -> hidden: gpt-oss's clamped SwiGLU with swiglu_limit, else `gated`."""
    if cfg.swiglu_limit is not None:
        return functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return gated(ACTIVATIONS[cfg.hidden_act])


class SparseMoE(nn.Module):
    """A mixture-of-experts MLP (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek), named as Qwen3-MoE's HF modules:
    the router `gate` and the `experts` (routing.route with `norm_topk_prob`, `softmax_topk` and
    DeepSeek's `routing`, whose selection bias is the param `e_score_correction_bias`). The routing
    weights are rounded to the model dtype (as Qwen3-MoE's) and applied before each expert's down
    projection (and to its bias: `use_bias`, on the router and the experts). With
    `shared_intermediate_size` (DeepSeek, GLM-4.5, Qwen2-MoE) a dense MLP of that width, `shared_experts`,
    adds its output for every token, with `shared_gate` (Qwen2-MoE) times sigmoid(shared_expert_gate(x)),
    a Linear to one output. Shapes are static whatever the routing, and each token's output depends
    on its own row only (padding rows change nothing). Grouped products on TPU, every expert on CPU
    and GPU (every_expert). With `expert_parallel` each device of the mesh's "model" axis holds
    num_experts / model whole experts (parallel.EXPERT_PARALLEL_RULES), and runs them alone."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    glu: Callable[[Any, Any], Any] = gated(nn.silu)   # (gate, up) -> h: experts_product
    dtype: jnp.dtype = jnp.float32
    mesh: Any = None   # an engine step's: its "model" axis splits each expert's intermediate dim
    use_bias: bool = False
    softmax_topk: bool = False
    routing: Routing | None = None
    shared_intermediate_size: int = 0
    activation: Callable[[Any], Any] = nn.silu   # the shared MLP's
    shared_gate: bool = False
    expert_parallel: bool = False   # the mesh's "model" axis splits the experts, whole (ModelConfig.expert_parallel)

    @nn.compact
    def __call__(self, x):
        lead, hidden = x.shape[:-1], x.shape[-1]
        x = x.reshape(-1, hidden).astype(self.dtype)
        routing = self.routing or Routing()
        bias = (self.param("e_score_correction_bias", nn.initializers.zeros, (self.num_experts,), jnp.float32)
                if routing.selection_bias else None)
        logits = Linear(self.num_experts, self.use_bias, jnp.float32 if self.routing else self.dtype, name="gate")(x)
        weights, chosen = route(logits, self.top_k, self.norm_topk_prob, self.softmax_topk, routing, bias)
        weights = weights.astype(self.dtype)
        experts = Experts(self.num_experts, self.intermediate_size, self.dtype, self.use_bias, name="experts")(hidden)
        down_bias = experts.pop("down_proj_bias", None)

        def run(*args):
            every = functools.partial(in_chunks, every_expert, glu=self.glu)
            return jax.lax.platform_dependent(*args, cpu=every, cuda=every,
                                              default=functools.partial(in_chunks, grouped_experts, glu=self.glu))
        tp = 1 if self.mesh is None else self.mesh.shape["model"]
        if tp > 1 and splits(experts, tp, self.expert_parallel):   # split as parallel's rules split them
            # Each device's share of every expert (or its own experts) gives partial sums, reduced
            # once a token's k rows are summed: [T, hidden] over the links. Left to XLA, the grouped
            # product's [T * k, hidden] rows were all-reduced (Qwen3-30B-A3B at TP 4 on v6e: 8x the bytes).
            def partial_sum(x, weights, chosen, experts, local=run):
                if self.expert_parallel:   # this device's experts, numbered from 0; the others' rows weigh 0
                    size = self.num_experts // tp
                    weights, chosen = routed_within(weights, chosen, jax.lax.axis_index("model") * size, size)
                return jax.lax.psum(local(x, weights, chosen, experts), "model")
            run = jax.shard_map(partial_sum, mesh=self.mesh, out_specs=P(), axis_names={"model"}, check_vma=False,
                                in_specs=(P(), P(), P(), split_specs(experts, self.expert_parallel)))
        out = run(x, weights, chosen, experts)
        if down_bias is not None:   # once, not once per device: each routed expert's, by its weight
            out = out + (weights[..., None] * down_bias[chosen]).sum(axis=1)
        if self.shared_intermediate_size:
            shared = GatedMLP(hidden, self.shared_intermediate_size, False, self.activation, self.dtype,
                              name="shared_experts")(x)
            if self.shared_gate:
                shared = shared * jax.nn.sigmoid(Linear(1, False, self.dtype, name="shared_expert_gate")(x))
            out = out + shared
        return out.reshape(*lead, hidden)


def rope_from_hf(hf: dict[str, Any], rope: dict[str, Any] | None = None) -> tuple[float, RopeScaling]:
    """(theta, scaling) from a HF config.json, read as transformers does. transformers >= 5 keeps
    both in `rope_parameters`; older configs split them into `rope_theta` and `rope_scaling`.
    `rope`: the RoPE dict to read instead of those (Gemma 3's, by layer type)."""
    if rope is None:
        rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
    max_len = hf.get("max_position_embeddings", 2048)
    # A top-level original_max_position_embeddings (Phi-3's) wins over the RoPE dict's.
    original = int(hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or max_len)
    factor = float(rope.get("factor") or (max_len / original if kind in ("yarn", "longrope") else 1.0))
    fraction = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    attention = rope.get("attention_factor")
    if attention is None and kind == "yarn":
        def mscale(m):
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        both = rope.get("mscale") and rope.get("mscale_all_dim")
        attention = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"]) if both else mscale(1.0)
    elif attention is None and kind == "longrope":
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    scaling = RopeScaling(
        kind=kind,
        factor=factor,
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        truncate=bool(rope.get("truncate", True)),
        short_factor=tuple(map(float, rope.get("short_factor") or ())),
        long_factor=tuple(map(float, rope.get("long_factor") or ())),
        attention_factor=float(attention or 1.0),
        rotary_fraction=fraction,
    )
    if kind == "longrope":
        rotary = int((hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]) * fraction)
        if not len(scaling.short_factor) == len(scaling.long_factor) == rotary // 2:
            raise ValueError(f"longrope needs short_factor and long_factor of {rotary // 2} values each (half the "
                             f"rotary dims), got {len(scaling.short_factor)} and {len(scaling.long_factor)}")
    return theta, scaling


def rope_by_layer_type(hf: dict[str, Any], local_theta: float | None = None) -> tuple[float, RopeScaling, float]:
    """(theta, scaling) of the full-attention layers and the unscaled RoPE base of the windowed ones
    (Gemma 3, OLMo 3). transformers 5 keeps both in `rope_parameters` by layer type; older configs
    have the global layers' in rope_theta / rope_scaling. `local_theta`: the windowed layers' base
    where the config has none (None: the global one)."""
    rope = hf.get("rope_parameters") or {}
    if "full_attention" not in rope:
        theta, scaling = rope_from_hf(hf)
        return theta, scaling, theta if local_theta is None else local_theta
    theta, scaling = rope_from_hf(hf, rope["full_attention"])
    local = rope.get("sliding_attention", {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"windowed layers with RoPE scaling {local['rope_type']!r} are not supported")
    return theta, scaling, float(local.get("rope_theta", theta if local_theta is None else local_theta))


def rope_frequencies(cfg: ModelConfig, local: bool = False) -> tuple[np.ndarray, float]:
    """(inverse frequencies, cos/sin scale) of a layer, transformers' formulas per kind; `local`: a
    sliding-window layer (Gemma 3 gives those their own unscaled base). The frequencies cover the
    rotating dims only (rotary_fraction)."""
    local = local and cfg.local_rope_theta is not None
    sc = RopeScaling(rotary_fraction=cfg.rope_scaling.rotary_fraction) if local else cfg.rope_scaling
    base = cfg.local_rope_theta if local else cfg.rope_theta
    d = int(cfg.head_dim * sc.rotary_fraction)
    context = sc.context_length or cfg.max_position_embeddings
    if sc.kind == "dynamic":   # NTK: a larger base for contexts past the model's length
        context = max(context, cfg.max_position_embeddings)
        base = base * (sc.factor * context / cfg.max_position_embeddings - (sc.factor - 1)) ** (d / (d - 2))
    inv_freq = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
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
    elif sc.kind == "yarn":   # interpolated (divided by factor) where few rotations fit the old length
        def dim_of(rotations):
            return d * math.log(sc.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low, high = dim_of(sc.beta_fast), dim_of(sc.beta_slow)
        if sc.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        ramp = np.clip((np.arange(d // 2) - low) / ((high - low) or 0.001), 0, 1)
        inv_freq = inv_freq / sc.factor * ramp + inv_freq * (1 - ramp)
    elif sc.kind == "longrope":
        long = context > sc.original_max_position_embeddings
        inv_freq = inv_freq / np.asarray(sc.long_factor if long else sc.short_factor, np.float64)
    return inv_freq.astype(np.float32), sc.attention_factor


def apply_rope(x, positions, inv_freq, scale: float = 1.0, interleaved: bool = False):
    """x [..., T, H, D] with positions [..., T]; HF's rotate-half convention over the first
    2 * len(inv_freq) dims (the rest pass through), computed in float32; cos and sin times `scale`.
    `interleaved`: frequency i rotates dims (2i, 2i + 1) instead of (i, i + R/2) (GPT-J, GLM)."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [..., T, R/2]
    cos, sin = jnp.cos(freqs)[..., None, :], jnp.sin(freqs)[..., None, :]
    if scale != 1.0:   # (static: no multiply in the programs of the kinds without it)
        cos, sin = cos * scale, sin * scale
    rotary = 2 * inv_freq.shape[-1]
    x32 = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x32[..., 0:rotary:2], x32[..., 1:rotary:2]
    else:
        x1, x2 = jnp.split(x32[..., :rotary], 2, axis=-1)
    r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = [jnp.stack([r1, r2], axis=-1).reshape(*r1.shape[:-1], rotary)] if interleaved else [r1, r2]
    rotated += [x32[..., rotary:]] if rotary < x.shape[-1] else []
    return jnp.concatenate(rotated, axis=-1).astype(x.dtype)
