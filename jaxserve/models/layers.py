"""Layers shared by the model families: Linear, RMSNorm, LayerNorm, rotary embeddings, the gated MLP.

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

from jaxserve import quantization
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.matmul import matmul_t

ROPE_KINDS = ("default", "linear", "llama3")
# HF `hidden_act` / `hidden_activation` names of the MLPs' activations.
ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
               "gelu": functools.partial(nn.gelu, approximate=False)}


class Linear(nn.Module):
    """x @ weight.T (+ bias), weight stored [out, in] as in PyTorch. Besides loading without a
    transpose, contracting the weight's contiguous last dim makes XLA CPU's decode steps 7-15%
    faster at 1-16 rows (benchmarks/results/roofline_cpu.md), more with `matmul_t`'s product by
    columns; accelerators take either layout.

    Every projection of every family goes through this class, so quantized weights belong here:
    params holding `qweight` and a scale instead of `weight` (jaxserve.quantization.quantize_params)
    are multiplied by quantization.matmul, which dequantizes inside the fused computation."""
    features: int
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        if self.has_variable("params", "qweight"):
            w8a8 = self.has_variable("params", quantization.SCALES["w8a8"])
            y = quantization.matmul(x, self.get_variable("params", "qweight"),
                                    self.get_variable("params", quantization.SCALES["w8a8" if w8a8 else "int8"]),
                                    self.dtype, int8_activations=w8a8)
        else:
            w = self.param("weight", nn.initializers.lecun_normal(in_axis=-1, out_axis=-2),
                           (self.features, x.shape[-1]), self.dtype)
            y = matmul_t(x.astype(self.dtype), w)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32
    # Gemma stores the scale minus one (offset 1.0) and scales in float32 before the cast, where
    # Llama casts first: each as its transformers implementation rounds.
    offset: float = 0.0

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        w = self.param("weight", init, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (xf * (self.offset + w.astype(jnp.float32))).astype(self.dtype)
        return w * xf.astype(self.dtype)


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm, computed in float32 (BLOOM, MPT)."""
    eps: float
    use_bias: bool
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
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


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from a HF config.json. transformers >= 5 keeps both in
    `rope_parameters`; older configs split them into `rope_theta` and `rope_scaling`."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_KINDS)})")
    scaling = RopeScaling(
        kind=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
    )
    return float(theta), scaling


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> np.ndarray:
    """The rotary frequencies of a layer; `local`: a sliding-window layer (Gemma 3 gives those
    their own unscaled base)."""
    d = cfg.head_dim
    local = local and cfg.local_rope_theta is not None
    inv_freq = 1.0 / ((cfg.local_rope_theta if local else cfg.rope_theta) ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = RopeScaling() if local else cfg.rope_scaling
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
