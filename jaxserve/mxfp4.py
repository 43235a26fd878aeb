"""MXFP4 (OCP microscaling 4-bit floats), as gpt-oss's checkpoints store their experts' weights
(quant_method "mxfp4"), dequantized as they are read.

A tensor `<name>` is stored as `<name>_blocks`, uint8 [..., out, in / 32, 16], and `<name>_scales`,
uint8 [..., out, in / 32]: each block of 32 inputs is 16 bytes of two e2m1 codes (the low nibble
the even input, the high nibble the odd one) and one e8m0 exponent stored plus 127, so
value = E2M1[code] * 2 ** (scale - 127). Dequantized, it is [..., in, out], as transformers'
dequantization (integrations/mxfp4.py) gives it and as the unquantized checkpoints store it.
"""
from __future__ import annotations

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
