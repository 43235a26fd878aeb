"""Hugging Face checkpoints saved already quantized, loaded as jaxserve's own int8, int4,
int4_asym or fp8 Linear (jaxserve/quantization.py) without going through full precision. Formats
read (weight-only, every Linear but the LM head quantized):

  * compressed-tensors (LLM Compressor; e.g. RedHatAI's *-quantized.w8a16 and .w4a16):
      - "int-quantized" (or "naive-quantized"), 8 bits symmetric per output channel -> int8:
        `<linear>.weight` int8 [out, in] and `.weight_scale` [out, 1], jaxserve's int8 as stored;
      - "pack-quantized", 4 bits in groups of 128 inputs -> int4, or int4_asym when asymmetric:
        `.weight_packed` int32 [out, in / 8] (input 8w + j in bits 4j..4j+3 of word w, stored
        plus 8), `.weight_scale` [out, in / 128] and, asymmetric, `.weight_zero_point` int32
        [out / 8, in / 128] (packed the same way along the outputs);
      - "float-quantized", 8-bit float (e4m3) weights per channel, per tensor or in 128x128
        blocks -> fp8 (RedHatAI's *-FP8-dynamic, LLM Compressor's FP8 schemes): `.weight`
        float8_e4m3fn [out, in] and `.weight_scale` [out, 1], [1] or [out / 128, in / 128]
        (weight = fp8 * scale).
  * FP8 (quant_method "fp8": transformers' FineGrainedFP8, DeepSeek's and Qwen's *-FP8), e4m3
    -> fp8: with `weight_block_size` [128, 128], `.weight` float8_e4m3fn [out, in] and
    `.weight_scale_inv` f32 or bf16 [ceil(out / 128), in / 128] (weight = fp8 * scale_inv, the
    "inverse" of the quantizing scale); without it (AutoFP8), a per-tensor `.weight_scale`.
  * GPTQ (AutoGPTQ / GPTQModel; e.g. Qwen's *-GPTQ-Int4), 4 bits in groups of 128 without
    act-order (desc_act false) -> int4 when sym, else int4_asym: `.qweight` int32 [in / 8, out]
    (input 8w + j in bits 4j of row w), `.scales` [in / 128, out], `.qzeros` int32
    [in / 128, out / 8] (packed along out; the original "gptq" format stores each zero point
    minus 1, modulo 16, "gptq_v2" as it is; sym means all are 8) and `.g_idx` [in] (input i's
    group: i // 128 without act-order).
  * AWQ (AutoAWQ's GEMM version; e.g. Qwen's *-AWQ), 4 bits in groups of 128 with zero points
    -> int4_asym: `.qweight` int32 [in, out / 8] and `.qzeros` int32 [in / 128, out / 8], packed
    along out with output 8w + AWQ_ORDER[j] in bits 4j of word w, and `.scales` [in / 128, out].

gpt-oss's MXFP4 experts (quant_method "mxfp4") load as stored, in jaxserve's mode of the same
name (jaxserve/mxfp4.py). A mixture's experts, stored one tensor per expert as any Linear (Qwen3-30B-A3B-FP8's and
DeepSeek-V3's block-FP8 `mlp.experts.E.*_proj.weight` with their `weight_scale_inv`), load stacked,
each expert's leaves as its Linear's (read); the routers are stored unquantized, as jaxserve keeps them.

Each 4-bit one is weight = scale * (code - zero point) with codes and zero points 0..15; the
codes are repacked on the host into int4's layout (quantization.pack_int4) and each zero point
becomes the offset scale * (zero point - 8), so a tensor loads to what the checkpoint stands for.
An FP8 weight loads as stored, its scale repeated into fp8's per row and 128 inputs.

FP8 checkpoints that quantize activations too (W8A8: dynamic per token, or static with an
`input_scale` per tensor) are served weight-only, their activations left in the model dtype,
and say so in the log: what vLLM does on GPUs without fp8 arithmetic. The weights are the
checkpoint's exactly; the products differ from a W8A8 engine's only by the activation rounding
it would add (more precise, not the same numbers). int8 activation quantization is refused.
Anything else (act-order, other group or block sizes, bit widths or fp8 formats, a quantized LM
head, modules left unquantized besides it) is refused, saying what is read.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Callable, NamedTuple

import ml_dtypes
import numpy as np

from jaxserve import mxfp4
from jaxserve.quantization import GROUP, MXFP4, ROUTERS, ZERO, pack_int4

COMPRESSED_INT8 = ("int-quantized", "naive-quantized")
COMPRESSED_INT4 = "pack-quantized"
COMPRESSED_FP8 = "float-quantized"
FP8_SCHEMES = tuple((8, "float", strategy, None) for strategy in ("channel", "tensor", "block"))
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}   # checkpoint_format -> what reading adds to a stored zero point
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)       # AWQ's GEMM packing: bits 4j of a word hold output AWQ_ORDER[j]
SUPPORTED = (f"compressed-tensors {' / '.join(COMPRESSED_INT8)} with 8-bit symmetric per-channel weights, "
             f"compressed-tensors {COMPRESSED_INT4}, GPTQ (no act-order) or AWQ (GEMM) with 4-bit weights in "
             f"groups of {GROUP}, compressed-tensors {COMPRESSED_FP8} or quant_method fp8 with e4m3 weights per "
             f"channel, per tensor or in {GROUP}x{GROUP} blocks, the LM head unquantized")
log = logging.getLogger(__name__)

Tensor = Callable[[str], np.ndarray]   # a checkpoint tensor by name, whole, on the host
# safetensors dtypes that its numpy reader cannot return ("module 'numpy' has no attribute
# 'float8_e4m3fn'"; bf16 it returns once ml_dtypes is imported): read from the bytes
FLOAT8 = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


class Stored(NamedTuple):
    """How a checkpoint's Linear weights are stored: as jaxserve's `mode` (int8, int4, int4_asym),
    read by `read(tensor, weight_name)` into that mode's {"qweight", "scale"} [out, ...], where
    weight_name is the unquantized weight's (`model.layers.0.mlp.down_proj.weight`)."""
    mode: str
    read: Callable[[Tensor, str], dict]


class BytesSlice:
    """A float8 safetensors tensor (FP8 checkpoints' weights), used as safe_open's lazy slices are
    (get_shape, [index]): a memory map of its bytes in the file, so indexing reads only what it selects."""

    def __init__(self, filename: str, name: str):
        with open(filename, "rb") as f:
            size = int.from_bytes(f.read(8), "little")   # the JSON header's, which the data follows
            entry = json.loads(f.read(size))[name]
        begin, end = entry["data_offsets"]
        self.array = np.memmap(filename, np.uint8, "r", 8 + size + begin, (end - begin,)).view(
            FLOAT8[entry["dtype"]]).reshape(entry["shape"])

    def get_shape(self) -> list[int]:
        return list(self.array.shape)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self.array[index])


def read(stored: Stored, tensor: Tensor, name: str | tuple[str, ...]) -> dict:
    """A Linear's leaves as stored.read gives them; a stack of experts' (`name`: each expert's
    weight name, in order) each expert's, stacked along a new first axis."""
    if isinstance(name, str):
        return stored.read(tensor, name)
    experts = [stored.read(tensor, n) for n in name]
    return {k: np.stack([e[k] for e in experts]) for k in experts[0]}


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
    if method == MXFP4:   # gpt-oss's experts, served as stored (jaxserve/mxfp4.py), the rest unquantized
        return Stored(MXFP4, mxfp4.read)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "fp8":
        return _fp8(qc)
    raise _unsupported(f"quant_method {method!r}")


def hf_quantization(model_dir: str) -> str | None:
    """The quantization mode of a supported pre-quantized checkpoint, None for an unquantized one."""
    s = stored(model_dir)
    return None if s is None else s.mode


def _compressed_tensors(qc: dict) -> Stored:
    schemes = set()   # (jaxserve mode, the weights' strategy)
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        activations = group.get("input_activations") or group.get("output_activations")
        if group.get("targets") != ["Linear"]:
            raise _unsupported(f"targets {group.get('targets')} in {name}")
        scheme = (w.get("num_bits"), w.get("type"), w.get("strategy"), w.get("actorder"))
        if activations and (fmt != COMPRESSED_FP8 or group.get("output_activations")):
            raise _unsupported(f"activation quantization in {name}")
        if fmt in COMPRESSED_INT8 and scheme == (8, "int", "channel", None) and w.get("symmetric"):
            schemes.add(("int8", "channel"))
        elif fmt == COMPRESSED_INT4 and scheme == (4, "int", "group", None) and w.get("group_size") == GROUP:
            schemes.add(("int4" if w.get("symmetric") else "int4_asym", "group"))
        elif (fmt == COMPRESSED_FP8 and scheme in FP8_SCHEMES and w.get("symmetric")
              and w.get("block_structure") == ([GROUP, GROUP] if scheme[2] == "block" else None)):
            schemes.add(("fp8", scheme[2]))
            if activations:
                _weight_only(f"{'dynamic' if activations.get('dynamic') else 'static'} fp8 activations")
        else:
            raise _unsupported(f"format {fmt!r} with weights {w} in {name}")
    if len(schemes) != 1:
        raise _unsupported(f"{'no' if not schemes else 'mixed'} weight schemes")
    _unquantized_alone(qc.get("ignore"), "ignore", lm_head=True)
    (mode, strategy), = schemes
    if mode == "fp8":
        return Stored(mode, lambda tensor, name: _fp8_leaves(name, tensor, "_scale", block=strategy == "block"))
    return Stored(mode, _read_int8 if mode == "int8" else lambda tensor, name: _read_packed(mode, tensor, name))


def _unquantized_alone(unquantized: list | None, key: str, lm_head: bool) -> None:
    """The modules a checkpoint leaves unquantized (its `key`) are the LM head (which must be
    among them when `lm_head`) and MoE routers alone, as read."""
    others = [m for m in unquantized or [] if m != "lm_head" and not _router(m)]
    if others:
        raise _unsupported(f"layers left unquantized besides lm_head and the routers: {key} {others}")
    if lm_head and "lm_head" not in (unquantized or []):
        raise _unsupported("a quantized lm_head")


def _router(module: str) -> bool:
    """Whether a module name, or an LLM Compressor pattern ("re:.*mlp.gate$"), names MoE routers,
    which are read unquantized (AutoAWQ's and LLM Compressor's MoE checkpoints leave them so)."""
    return module.removeprefix("re:").removesuffix("$").rsplit(".", 1)[-1] in ROUTERS


def _weight_only(what: str) -> None:
    log.warning("pre-quantized checkpoint with %s: served weight-only, the activations left in the model "
                "dtype (the fp8 weights are used exactly; no activation rounding)", what)


def _fp8(qc: dict) -> Stored:
    """quant_method "fp8": 128x128 blocks with `weight_block_size` (scales `.weight_scale_inv`),
    else AutoFP8's one scale per tensor (`.weight_scale`). `modules_to_not_convert` is not read:
    Qwen's lists norms and embeddings beside lm_head, so each Linear is checked as it is read
    instead (_fp8_leaves), and an fp8 lm_head, which transformers never writes, is refused there
    too (checkpoint._place)."""
    block = qc.get("weight_block_size")
    if qc.get("fmt", "e4m3") != "e4m3" or block not in (None, [GROUP, GROUP]):
        raise _unsupported(f"fp8 fmt={qc.get('fmt')!r} weight_block_size={block}")
    _weight_only(f"{qc.get('activation_scheme', 'dynamic')} fp8 activations")
    suffix = "_scale_inv" if block else "_scale"
    return Stored("fp8", lambda tensor, name: _fp8_leaves(name, tensor, suffix, block=bool(block)))


def _fp8_leaves(name: str, tensor: Tensor, scale_suffix: str, block: bool) -> dict:
    """fp8's leaves of the e4m3 weight `name` [out, in] and its scale (name + scale_suffix): per
    128x128 block (block: [ceil(out / 128), in / 128], each repeated over its 128 rows), per
    output channel ([out, 1]) or per tensor ([1] or []), as one scale per output row and 128 inputs."""
    weight = tensor(name)
    if weight.dtype != ml_dtypes.float8_e4m3fn:   # e5m2, or a Linear left unquantized
        raise _unsupported(f"{name} is {weight.dtype}, not float8_e4m3fn")
    out, inp = weight.shape
    scale = np.asarray(tensor(name + scale_suffix), np.float32)   # f32 or bf16 in the checkpoint
    rows = np.repeat(scale, GROUP, axis=0)[:out] if block else scale.reshape(-1, 1)
    return {"qweight": weight, "scale": np.ascontiguousarray(np.broadcast_to(rows, (out, -(-inp // GROUP))))}


def _gptq(qc: dict) -> Stored:
    fmt = qc.get("checkpoint_format", "gptq")
    scheme = (qc.get("bits"), qc.get("group_size"), bool(qc.get("desc_act")), fmt in GPTQ_FORMATS)
    if scheme != (4, GROUP, False, True):
        raise _unsupported(f"GPTQ bits={qc.get('bits')} group_size={qc.get('group_size')} "
                           f"desc_act={qc.get('desc_act')} checkpoint_format={fmt!r}")
    if qc.get("lm_head") or qc.get("dynamic"):
        raise _unsupported("GPTQ with a quantized lm_head or per-module (dynamic) settings")
    mode = "int4" if qc.get("sym", True) else "int4_asym"

    def read(tensor: Tensor, weight_name: str) -> dict:
        base = weight_name.removesuffix("weight")
        codes = _nibbles(tensor(base + "qweight"), axis=0).T   # [out, in]
        try:
            g_idx = tensor(base + "g_idx")
        except ValueError:   # optional without act-order
            g_idx = None
        if g_idx is not None and not np.array_equal(g_idx, np.arange(codes.shape[1]) // GROUP):
            raise _unsupported(f"{base}g_idx reorders the inputs' groups (act-order)")
        zeros = (_nibbles(tensor(base + "qzeros"), axis=1) + GPTQ_FORMATS[fmt]) & 0xF
        return _int4(mode, base + "qzeros", codes, tensor(base + "scales").T, zeros.T)
    return Stored(mode, read)


def _awq(qc: dict) -> Stored:
    scheme = (qc.get("bits"), qc.get("group_size"), qc.get("zero_point"), str(qc.get("version")).lower())
    if scheme != (4, GROUP, True, "gemm"):
        raise _unsupported(f"AWQ bits={qc.get('bits')} group_size={qc.get('group_size')} zero_point="
                           f"{qc.get('zero_point')} version={qc.get('version')!r}")
    _unquantized_alone(qc.get("modules_to_not_convert"), "modules_to_not_convert", lm_head=False)
    undo = np.argsort(AWQ_ORDER)

    def by_output(words: np.ndarray) -> np.ndarray:   # [rows, out / 8] AWQ-packed -> [rows, out]
        values = _nibbles(words, axis=1)
        return values.reshape(values.shape[0], -1, 8)[..., undo].reshape(values.shape[0], -1)

    def read(tensor: Tensor, weight_name: str) -> dict:
        base = weight_name.removesuffix("weight")
        return _int4("int4_asym", base + "qzeros", by_output(tensor(base + "qweight")).T,
                     tensor(base + "scales").T, by_output(tensor(base + "qzeros")).T)
    return Stored("int4_asym", read)


def _read_int8(tensor: Tensor, weight_name: str) -> dict:
    return {"qweight": tensor(weight_name).astype(np.int8),
            "scale": tensor(weight_name + "_scale").astype(np.float32).reshape(-1)}


def _read_packed(mode: str, tensor: Tensor, weight_name: str) -> dict:
    codes = _nibbles(tensor(weight_name + "_packed"), axis=1)   # [out, in]
    zeros = (np.full((codes.shape[0], 1), 8) if mode == "int4" else
             _nibbles(tensor(weight_name + "_zero_point"), axis=0)[:codes.shape[0]])
    return _int4(mode, weight_name + "_zero_point", codes, tensor(weight_name + "_scale"), zeros)


def _int4(mode: str, zeros_name: str, codes: np.ndarray, scale: np.ndarray, zeros: np.ndarray) -> dict:
    """jaxserve's leaves in `mode` for weight = scale * (codes - zeros): codes [out, in] and zero
    points [out, in / 128] (or [out, 1]: all alike) 0..15, scale [out, in / 128]."""
    scale = np.ascontiguousarray(scale, dtype=np.float32)
    leaves = {"qweight": pack_int4(codes.astype(np.int8) - 8), "scale": scale}
    if mode == "int4_asym":
        leaves[ZERO] = (zeros.astype(np.float32) - 8) * scale
    elif np.any(zeros != 8):
        raise _unsupported(f"{zeros_name} holds zero points other than 8 in a symmetric checkpoint")
    return leaves


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 4-bit values (0..15), element j of a word from bits 4j..4j+3, the
    8 of each word in a row along `axis` (0: [R, C] -> [8R, C]; 1: [R, C] -> [R, 8C])."""
    shifts = np.arange(8, dtype=np.uint32) * 4
    values = (words.astype(np.int32).view(np.uint32)[..., None] >> shifts) & 0xF   # [R, C, 8]
    if axis == 0:
        values = values.transpose(0, 2, 1)
    return values.reshape(words.shape[0] * (8 if axis == 0 else 1), -1).astype(np.uint8)
