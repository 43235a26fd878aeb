"""MXFP4 (OCP microscaling 4-bit floats), as gpt-oss's checkpoints store their experts' weights
(quant_method "mxfp4"), served as stored: 4.25 bits a weight.

A tensor `<name>` is stored as `<name>_blocks`, uint8 [..., out, in / 32, 16], and `<name>_scales`,
uint8 [..., out, in / 32]: each block of 32 inputs is 16 bytes of two e2m1 codes (the low nibble
the even input, the high nibble the odd one) and one e8m0 exponent stored plus 127, so
value = E2M1[code] * 2 ** (scale - 127). Dequantized, it is [..., in, out], as transformers'
dequantization (integrations/mxfp4.py) gives it and as the unquantized checkpoints store it.

Served, a stack of experts holds quantization.py's leaves (its mode "mxfp4", read from
checkpoints only): qweight uint8 [..., out, in / 2], the blocks' bytes in order, and scale uint8
[..., out, in / 32], the exponents; jaxserve/models/experts.py dequantizes them a chunk of experts
at a time inside the expert products (dequantize_jnp: a lookup of the 16 codes' values times the
block's power of two, exact in bf16 and f32). The Dequantized reader serves `--quantization`,
which requantizes the weights from their dequantized values.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

BLOCK = 32   # inputs per scale
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., out, groups * 32] of codes [..., out, groups, 16] and exponents [..., out, groups]."""
    values = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1)   # [..., groups, 16, 2]: even, odd input
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None, None])
    return values.reshape(*blocks.shape[:-2], -1)


class Dequantized:
    """An MXFP4 tensor [..., in, out] read from lazy slices of its blocks and scales, as a lazy
    safetensors slice is (get_shape, [index]): indexing reads the whole blocks that cover what it selects."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales

    def get_shape(self) -> tuple[int, ...]:
        *lead, out, groups, _ = self.blocks.get_shape()
        return (*lead, groups * BLOCK, out)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        *lead, inputs, outputs = index
        start = inputs.start or 0
        stop = self.get_shape()[-2] if inputs.stop is None else inputs.stop
        first = start // BLOCK
        groups = slice(first, -(-stop // BLOCK))
        x = dequantize(np.asarray(self.blocks[(*lead, outputs, groups, slice(None))]),
                       np.asarray(self.scales[(*lead, outputs, groups)]))
        return np.swapaxes(x[..., start - first * BLOCK:stop - first * BLOCK], -1, -2)


def read(tensor, name: str) -> dict:
    """A stored MXFP4 tensor `name` [..., out, in] (`tensor`: a checkpoint's tensors by name) as
    served: {"qweight": its blocks [..., out, in / 2], "scale": its exponents [..., out, in / 32]}."""
    blocks = tensor(f"{name}_blocks")
    return {"qweight": blocks.reshape(*blocks.shape[:-2], -1), "scale": tensor(f"{name}_scales")}


def written(leaf: str, x: np.ndarray, node: dict) -> tuple[str, np.ndarray]:
    """read's inverse, for save_pretrained: the suffix and tensor that store the quantized leaf
    `leaf` ("qweight" or "scale", `x`) of `node`. ValueError unless the node is MXFP4 (its scale
    uint8): no other quantized weight is written as a Hugging Face checkpoint."""
    if "scale" not in node or np.dtype(node["scale"].dtype) != np.uint8:
        raise ValueError("save_pretrained writes unquantized or MXFP4 weights only: load the checkpoint unquantized "
                         "to write it")
    return ("_blocks", x.reshape(*x.shape[:-1], -1, BLOCK // 2)) if leaf == "qweight" else ("_scales", x)


def quantization_config(hf_config: dict) -> dict:
    """config.json's quantization_config for weights written in MXFP4: the model's own where it is
    MXFP4's, else the one the Hub's gpt-oss checkpoints give (everything but the experts unquantized)."""
    qc = hf_config.get("quantization_config") or {}
    return qc if qc.get("quant_method") == "mxfp4" else {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def dequantize_jnp(qweight, scale, dtype):
    """The weights [..., out, in] in `dtype` of read's leaves."""
    table = jnp.asarray(E2M1, dtype)
    values = jnp.stack([table[qweight & 0x0F], table[qweight >> 4]], axis=-1)   # [..., in / 2, 2]: even, odd input
    powers = jnp.exp2(scale.astype(jnp.float32) - 127).astype(dtype)
    return (values.reshape(*scale.shape, BLOCK) * powers[..., None]).reshape(*qweight.shape[:-1], -1)


def quantize(w) -> dict:
    """read's leaves of weights [..., out, in] (what a weight update or a shape needs): each block's
    exponent is floor(log2(its largest magnitude)) - 2 (E2M1's largest, 6, is 1.5 * 2^2), each value
    the nearest code (6 at most: OCP's clamp)."""
    blocks = jnp.asarray(w, jnp.float32).reshape(*w.shape[:-1], -1, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    exponent = jnp.clip(jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1))) - 2, -127), -127, 127)
    scaled = blocks / jnp.exp2(exponent)[..., None]
    magnitude = jnp.argmin(jnp.abs(jnp.abs(scaled)[..., None] - E2M1[:8]), axis=-1)
    codes = (magnitude + 8 * (scaled < 0)).astype(jnp.uint8).reshape(*blocks.shape[:-1], BLOCK // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return {"qweight": packed.reshape(*w.shape[:-1], -1), "scale": (exponent + 127).astype(jnp.uint8)}
