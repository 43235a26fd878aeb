"""Hugging Face checkpoints saved already quantized: compressed-tensors int8 weight-only.

The format chosen is compressed-tensors' "int-quantized" (also written "naive-quantized") with
8-bit symmetric per-channel weights and no activation quantization (LLM Compressor's W8A16):
its tensors are exactly jaxserve's int8 Linear (`<linear>.weight` int8 [out, in] and
`<linear>.weight_scale` [out, 1]), so it loads without dequantizing, and transformers reads it
on CPU with the `compressed-tensors` package (the tests' reference). GPTQ, AWQ and
compressed-tensors' packed int4 (zero points, their own packing orders) are not read yet.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

FORMATS = ("int-quantized", "naive-quantized")
SCALE_SUFFIX = "_scale"


def _unsupported(why: str) -> ValueError:
    return ValueError(f"unsupported pre-quantized checkpoint: {why} (supported: compressed-tensors "
                      f"{' / '.join(FORMATS)} with 8-bit symmetric per-channel int weights only)")


def hf_quantization(model_dir: str) -> str | None:
    """"int8" for a supported compressed-tensors checkpoint, None for an unquantized one;
    anything else quantized fails here, saying what is supported."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    if qc.get("quant_method") != "compressed-tensors":
        raise _unsupported(f"quant_method {qc.get('quant_method')!r}")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        if fmt not in FORMATS:
            raise _unsupported(f"format {fmt!r} in {name}")
        if group.get("input_activations") or group.get("output_activations"):
            raise _unsupported(f"activation quantization in {name}")
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (8, "int", True, "channel"):
            raise _unsupported(f"weights {w} in {name}")
        if group.get("targets") != ["Linear"]:
            raise _unsupported(f"targets {group.get('targets')} in {name}")
    if set(qc.get("ignore") or []) - {"lm_head"}:
        raise _unsupported(f"layers left unquantized besides lm_head: {qc['ignore']}")
    if "lm_head" not in (qc.get("ignore") or []):
        raise _unsupported("a quantized lm_head (jaxserve keeps the LM head in the model dtype)")
    return "int8"


def read_scale(open_file: Any, weight_name: str, rows: tuple[int, int] | None) -> np.ndarray:
    """The f32 [out] per-channel scale stored beside `weight_name` (its rows of a fused tensor)."""
    scale = open_file.get_tensor(weight_name + SCALE_SUFFIX).astype(np.float32).reshape(-1)
    return scale if rows is None else scale[rows[0]:rows[1]]
