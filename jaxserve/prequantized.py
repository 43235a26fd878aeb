"""Hugging Face checkpoints saved already quantized, loaded as jaxserve's own int8 or int4 Linear
(jaxserve/quantization.py) without going through full precision. Formats read (weight-only,
symmetric, every Linear but the LM head quantized):

  * compressed-tensors (LLM Compressor; e.g. RedHatAI's *-quantized.w8a16 and .w4a16):
      - "int-quantized" (or "naive-quantized"), 8 bits per output channel -> int8:
        `<linear>.weight` int8 [out, in] and `.weight_scale` [out, 1], jaxserve's int8 as stored;
      - "pack-quantized", 4 bits in groups of 128 inputs -> int4: `.weight_packed` int32
        [out, in / 8] (input 8w + j in bits 4j..4j+3 of word w, stored plus 8) and
        `.weight_scale` [out, in / 128].
  * GPTQ (AutoGPTQ / GPTQModel; e.g. Qwen's *-GPTQ-Int4) with bits 4, sym, group_size 128 and
    no act-order (desc_act false) -> int4: `.qweight` int32 [in / 8, out] (input 8w + j in bits
    4j of row w, stored plus 8), `.scales` [in / 128, out], `.qzeros` int32 [in / 128, out / 8]
    (packed as qweight along out; symmetric means every zero point is 8, written 7 by the
    original "gptq" format, which adds 1 when reading, and 8 by "gptq_v2") and `.g_idx` [in]
    (input i's group, i // 128 without act-order).

The 4-bit codes are repacked on the host into int4's layout (quantization.pack_int4): the same
codes and scales, so a tensor loads to exactly what the checkpoint stands for. Anything else
(AWQ's per-group zero points, other group sizes, act-order, activation quantization, a quantized
LM head) is refused, saying what is read.
"""
from __future__ import annotations

import json
import os
from typing import Callable, NamedTuple

import numpy as np

from jaxserve.quantization import GROUP, pack_int4

COMPRESSED_INT8 = ("int-quantized", "naive-quantized")
COMPRESSED_INT4 = "pack-quantized"
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}   # checkpoint_format -> what reading adds to a stored zero point
SUPPORTED = (f"compressed-tensors {' / '.join(COMPRESSED_INT8)} with 8-bit symmetric per-channel weights, "
             f"compressed-tensors {COMPRESSED_INT4} or GPTQ with 4-bit symmetric weights in groups of {GROUP} "
             f"(no act-order), the LM head unquantized")

Tensor = Callable[[str], np.ndarray]   # a checkpoint tensor by name, whole, on the host


class Stored(NamedTuple):
    """How a checkpoint's Linear weights are stored: as jaxserve's `mode` ("int8" or "int4"),
    read by `read(tensor, weight_name)` into that mode's {"qweight", "scale"} [out, ...], where
    weight_name is the unquantized weight's (`model.layers.0.mlp.down_proj.weight`)."""
    mode: str
    read: Callable[[Tensor, str], dict]


def _unsupported(why: str) -> ValueError:
    return ValueError(f"unsupported pre-quantized checkpoint: {why} (supported: {SUPPORTED})")


def stored(model_dir: str) -> Stored | None:
    """The checkpoint's quantization (None for an unquantized one); anything quantized that is
    not read fails here, saying what is."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        qc = json.load(f).get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    raise _unsupported(f"quant_method {method!r}")


def hf_quantization(model_dir: str) -> str | None:
    """"int8" or "int4" for a supported pre-quantized checkpoint, None for an unquantized one."""
    s = stored(model_dir)
    return None if s is None else s.mode


def _compressed_tensors(qc: dict) -> Stored:
    modes = set()
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        if group.get("input_activations") or group.get("output_activations"):
            raise _unsupported(f"activation quantization in {name}")
        if group.get("targets") != ["Linear"]:
            raise _unsupported(f"targets {group.get('targets')} in {name}")
        scheme = (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy"), w.get("actorder"))
        if fmt in COMPRESSED_INT8 and scheme == (8, "int", True, "channel", None):
            modes.add("int8")
        elif fmt == COMPRESSED_INT4 and scheme == (4, "int", True, "group", None) and w.get("group_size") == GROUP:
            modes.add("int4")
        else:
            raise _unsupported(f"format {fmt!r} with weights {w} in {name}")
    if len(modes) != 1:
        raise _unsupported(f"{'no' if not modes else 'mixed'} weight schemes")
    if set(qc.get("ignore") or []) - {"lm_head"}:
        raise _unsupported(f"layers left unquantized besides lm_head: {qc['ignore']}")
    if "lm_head" not in (qc.get("ignore") or []):
        raise _unsupported("a quantized lm_head")
    return Stored("int8", _read_int8) if modes == {"int8"} else Stored("int4", _read_packed)


def _gptq(qc: dict) -> Stored:
    fmt = qc.get("checkpoint_format", "gptq")
    scheme = (qc.get("bits"), qc.get("group_size"), qc.get("sym"), bool(qc.get("desc_act")), fmt in GPTQ_FORMATS)
    if scheme != (4, GROUP, True, False, True):
        raise _unsupported(f"GPTQ bits={qc.get('bits')} group_size={qc.get('group_size')} sym={qc.get('sym')} "
                           f"desc_act={qc.get('desc_act')} checkpoint_format={fmt!r}")
    if qc.get("lm_head") or qc.get("dynamic"):
        raise _unsupported("GPTQ with a quantized lm_head or per-module (dynamic) settings")

    def read(tensor: Tensor, weight_name: str) -> dict:
        base = weight_name.removesuffix("weight")
        codes = _nibbles(tensor(base + "qweight"), axis=0).T.astype(np.int8) - 8   # [out, in]
        zeros = _nibbles(tensor(base + "qzeros"), axis=1) + GPTQ_FORMATS[fmt]
        if np.any(zeros != 8):
            raise _unsupported(f"{base}qzeros holds zero points other than 8 (asymmetric weights)")
        try:
            g_idx = tensor(base + "g_idx")
        except ValueError:   # optional without act-order
            g_idx = None
        if g_idx is not None and not np.array_equal(g_idx, np.arange(codes.shape[1]) // GROUP):
            raise _unsupported(f"{base}g_idx reorders the inputs' groups (act-order)")
        scale = tensor(base + "scales").astype(np.float32).T
        return {"qweight": pack_int4(codes), "scale": np.ascontiguousarray(scale)}
    return Stored("int4", read)


def _read_int8(tensor: Tensor, weight_name: str) -> dict:
    return {"qweight": tensor(weight_name).astype(np.int8),
            "scale": tensor(weight_name + "_scale").astype(np.float32).reshape(-1)}


def _read_packed(tensor: Tensor, weight_name: str) -> dict:
    codes = _nibbles(tensor(weight_name + "_packed"), axis=1).astype(np.int8) - 8   # [out, in]
    return {"qweight": pack_int4(codes), "scale": tensor(weight_name + "_scale").astype(np.float32)}


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 4-bit values (0..15), element j of a word from bits 4j..4j+3, the
    8 of each word in a row along `axis` (0: [R, C] -> [8R, C]; 1: [R, C] -> [R, 8C])."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    values = (words.astype(np.int32).view(np.uint32)[..., None] >> shifts) & 0xF   # [R, C, 8]
    if axis == 0:
        values = values.transpose(0, 2, 1)
    return values.reshape(words.shape[0] * (8 if axis == 0 else 1), -1).astype(np.uint8)
