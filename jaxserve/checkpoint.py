"""Checkpoints: Hugging Face safetensors <-> the Flax params pytree, and an orbax copy.

Loading reads tensors with safetensors' lazy slices (no PyTorch), renames them to the Flax
tree by the family's name map (jaxserve.models.registry; Linear weights keep PyTorch's [out, in];
a param held in a fused tensor is a row range of it; MXFP4 tensors are dequantized, mxfp4.py) and
places each one on device. With `shardings` each device reads only its own slice, so a large
model is never whole on one device. With `quantization` each Linear weight is quantized as soon
as it is read (jaxserve/quantization.py), so the full-precision model is never whole either.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve import mxfp4, parallel, prequantized, quantization as quant
from jaxserve.config import ModelConfig
from jaxserve.models import init_params
from jaxserve.models.moe import Interleaved
from jaxserve.models.registry import architecture, stored_transposed

ORBAX_DIR = "orbax"
# beside ORBAX_DIR: {"quantization": null | a mode, "quantize_lm_head": whether the LM head is too}
QUANTIZATION_FILE = "quantization.json"


def resolve_dtype(name: str):
    """EngineConfig.dtype as a jnp dtype; auto: float32 on a CPU, bfloat16 on an accelerator."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


@functools.cache
def param_shapes(cfg: ModelConfig, dtype=jnp.float32, quantization: str | None = None,
                 lm_head: bool = False) -> dict:
    """The params pytree of `cfg` as ShapeDtypeStructs (no memory allocated), quantized or not
    (`lm_head`: the LM head too). Cached: it traces the model's init (0.4 s for a 2-layer test
    model; an engine's build asked twice), and callers only read it."""
    _check_quantizable(cfg, quantization)
    return jax.eval_shape(lambda key: quant.quantize_params(init_params(cfg, key, dtype), quantization,
                                                            lm_head=lm_head), jax.random.key(0))


def _check_quantizable(cfg: ModelConfig, mode: str | None) -> None:
    """A mixture of experts' stacked weights are quantized in quant.EXPERT_MODES only."""
    if mode is not None and cfg.num_experts and mode not in quant.EXPERT_MODES:
        raise ValueError(f"{cfg.architecture} is a mixture-of-experts model: its experts cannot be quantized as {mode} "
                         f"(given or pre-quantized in the checkpoint); quantized experts are {', '.join(quant.EXPERT_MODES)}")


class _Stacked:
    """Several same-shaped lazy safetensors slices read as one tensor stacked along a new first
    axis (a param that hf_tensor names as a tuple: MoE experts); indexing reads only what it selects."""

    def __init__(self, slices: list):
        self.slices = slices

    def get_shape(self) -> tuple[int, ...]:
        shapes = {tuple(t.get_shape()) for t in self.slices}
        return (len(self.slices), *shapes.pop()) if len(shapes) == 1 else tuple(sorted(shapes))

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return np.stack([t[index[1:]] for t in self.slices[index[0]]])


class _Transposed:
    """A lazy slice read with its last two axes swapped (GPT-2's Conv1D weights, stored [in, out];
    gpt-oss's experts, [experts, in, out]): indexing reads only what it selects."""

    def __init__(self, stored):
        self.stored = stored

    def get_shape(self) -> tuple[int, ...]:
        *lead, rows, cols = self.stored.get_shape()
        return (*lead, cols, rows)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        return np.swapaxes(np.asarray(self.stored[(*index[:-2], index[-1], index[-2])]), -1, -2)


class _Interleaved:
    """The rows of a lazy slice's axis 1 a moe.Interleaved selects: indexing reads those covering them."""

    def __init__(self, tensor, where: Interleaved):
        self.tensor, self.where = tensor, where

    def get_shape(self) -> tuple[int, ...]:
        experts, rows, *rest = self.tensor.get_shape()
        return (experts, rows // self.where.parts, *rest)

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        n = self.where.parts
        rows = slice((index[1].start or 0) * n, None if index[1].stop is None else index[1].stop * n)
        return np.asarray(self.tensor[(index[0], rows, *index[2:])])[:, self.where.index::n]


def _tensor_index(model_dir: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the shard index or the single file."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(model_dir, v) for k, v in weight_map.items()}
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    out = {}
    for fn in files:
        with safe_open(fn, framework="np") as f:
            out.update({k: fn for k in f.keys()})
    return out


def has_tensor(model_dir: str, name: str) -> bool:
    """Whether an HF checkpoint (not an orbax one) holds the tensor `name`."""
    return is_orbax_checkpoint(model_dir) or name in _tensor_index(model_dir)


def read_tensor(model_dir: str, name: str, rows: list[int] | None = None) -> np.ndarray:
    """A tensor of an HF checkpoint in f32, whole or only `rows` of it (a sequence classifier's
    score head, or the LM head's rows of a few tokens, read on the host)."""
    index = {} if is_orbax_checkpoint(model_dir) else _tensor_index(model_dir)
    name = _as_in_checkpoint(name, index)
    if name not in index:
        raise ValueError(f"{model_dir} has no tensor {name!r} in its safetensors files")
    with safe_open(index[name], framework="np") as f:
        if rows is None:
            return f.get_tensor(name).astype(np.float32)
        tensor = f.get_slice(name)
        return np.concatenate([tensor[r:r + 1] for r in rows]).astype(np.float32)


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.isdir(os.path.join(model_dir, ORBAX_DIR))


def load_params(model_dir: str, cfg: ModelConfig, dtype=jnp.float32, shardings: Any = None,
                quantization: str | None = None, lm_head: bool = False) -> dict:
    """Load a HF safetensors directory (or one written by `convert_to_orbax`) into params,
    quantized when `quantization` is given, the LM head too with `lm_head` (`shardings` are then
    the quantized tree's)."""
    if is_orbax_checkpoint(model_dir):
        return _load_orbax(model_dir, cfg, dtype, shardings, quantization, lm_head)
    stored = prequantized.stored(model_dir)
    if stored is not None and quantization not in (None, stored.mode):
        raise ValueError(f"{model_dir} holds {stored.mode} weights; it cannot be loaded as {quantization}")
    if stored is not None and lm_head:
        raise ValueError(f"{model_dir} holds {stored.mode} weights: its LM head is loaded as stored")
    quant.check_head(quantization, lm_head)
    _check_quantizable(cfg, quantization or (stored and stored.mode))
    shapes = param_shapes(cfg, dtype)
    index = _tensor_index(model_dir)
    hf_tensor = architecture(cfg.architecture).hf_tensor
    open_files: dict[str, Any] = {}

    def lazy(name: str | tuple[str, ...], shape: tuple[int, ...] | None = None):   # as a lazy safetensors slice
        if isinstance(name, tuple):
            return _Stacked([lazy(n, None if shape is None else shape[1:]) for n in name])
        name = _as_in_checkpoint(name, index)
        if name not in index and f"{name}_blocks" in index:   # MXFP4 (gpt-oss's experts)
            return mxfp4.Dequantized(lazy(f"{name}_blocks"), lazy(f"{name}_scales"))
        if name not in index:
            raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r}"
                             + ("" if shape is None else f" (expected shape {tuple(shape)})"))
        if index[name] not in open_files:
            open_files[index[name]] = safe_open(index[name], framework="np")
        tensor = open_files[index[name]].get_slice(name)
        return prequantized.BytesSlice(index[name], name) if tensor.get_dtype() in prequantized.FLOAT8 else tensor

    params: dict = {}
    try:
        for path, spec in jax.tree_util.tree_flatten_with_path(shapes)[0]:
            keys = tuple(k.key for k in path)
            name, rows = hf_tensor(keys, cfg)
            mode = quantization or (stored and stored.mode)
            quantize = mode is not None and quant.quantizable(keys, spec, lm_head, mode)
            if quantize and stored:   # read as stored, in jaxserve's layout
                quant.set_path(params, quant.quantized_node(keys), _place_stored(
                    stored, lambda n: lazy(n)[:], name, rows, spec,
                    None if shardings is None else quant.node(shardings, quant.quantized_node(keys))))
                continue
            tensor = lazy(name, spec.shape)
            if stored_transposed(cfg, keys, len(spec.shape)):
                tensor = _Transposed(tensor)
            if isinstance(rows, Interleaved):
                tensor, rows = _Interleaved(tensor, rows), None
            hf_shape = tuple(tensor.get_shape())
            fits = (hf_shape == tuple(spec.shape) if rows is None
                    else hf_shape[0] >= rows[1] and hf_shape[1:] == tuple(spec.shape[1:]))
            if not fits:
                raise ValueError(f"tensor {name!r} has shape {hf_shape} in the checkpoint, expected "
                                 f"{tuple(spec.shape)}" + ("" if rows is None else f" at rows {rows[0]}:{rows[1]}"))
            leaf = _place(tensor, spec, _read_sharding(shardings, keys, quantize), None if rows is None else rows[0])
            if quantize:
                leaf = quant.quantize_placed(leaf, quantization,
                                             None if shardings is None else quant.node(shardings, quant.quantized_node(keys)))
            quant.set_path(params, quant.quantized_node(keys) if quantize else keys, leaf)
    finally:
        open_files.clear()
    if lm_head:
        quant.tied_head(params, quantization, shardings)
    return params


def _place_stored(stored: prequantized.Stored, tensor, name: str, rows, spec, shardings: dict | None) -> dict:
    """A pre-quantized Linear's {"qweight", "scale"} (its rows of a fused tensor), checked
    against the shapes its quantization gives `spec` and placed by `shardings` (None: default device)."""
    want = jax.eval_shape(functools.partial(quant.quantize_weight, mode=stored.mode), spec)
    leaf = {}
    for k, x in prequantized.read(stored, tensor, name).items():
        x = x if rows is None else x[:, rows.index::rows.parts] if isinstance(rows, Interleaved) else x[rows[0]:rows[1]]
        if x.shape != want[k].shape:
            raise ValueError(f"{name} of the pre-quantized checkpoint reads as a {k} of shape {x.shape}, expected "
                             f"{want[k].shape}")
        leaf[k] = _place(x, jax.ShapeDtypeStruct(x.shape, x.dtype), None if shardings is None else shardings[k], None)
    return leaf


def _read_sharding(shardings: Any, keys: tuple[str, ...], quantize: bool):
    """Where the full-precision param at `keys` goes: a weight to be quantized as its qweight."""
    if shardings is None:
        return None
    return quant.node(shardings, quant.quantized_node(keys))["qweight"] if quantize else quant.node(shardings, keys)


def load_for_mesh(model_dir: str, cfg: ModelConfig, dtype, quantization: str | None, mesh,
                  lm_head: bool = False) -> dict:
    """The params of `model_dir` placed on `mesh`, quantized as `quantization` and `lm_head` ask
    (None, False: as the checkpoint was saved); each device reads only its own slice of every weight."""
    quantization = quantization or saved_quantization(model_dir)
    lm_head = lm_head or saved_lm_head(model_dir)
    shapes = param_shapes(cfg, dtype, quantization, lm_head)
    return load_params(model_dir, cfg, dtype, quantization=quantization, lm_head=lm_head,
                       shardings=parallel.param_shardings(shapes, mesh, cfg))


def _saved(model_dir: str) -> dict:
    """An orbax checkpoint's QUANTIZATION_FILE ({} where there is none)."""
    path = os.path.join(model_dir, QUANTIZATION_FILE)
    if not is_orbax_checkpoint(model_dir) or not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def saved_quantization(model_dir: str) -> str | None:
    """How the checkpoint's weights are stored quantized: as an orbax checkpoint was written, or
    a pre-quantized HF checkpoint (jaxserve/prequantized.py); None: not quantized."""
    if not is_orbax_checkpoint(model_dir):
        return prequantized.hf_quantization(model_dir)
    return _saved(model_dir).get("quantization")


def saved_lm_head(model_dir: str) -> bool:
    """Whether an orbax checkpoint was written with its LM head quantized."""
    return _saved(model_dir).get("quantize_lm_head", False)


def _as_in_checkpoint(name: str, index: dict[str, str]) -> str:
    """`name`, or without its first component where only that is in the checkpoint: one saved
    from the base model (BLOOM's bigscience checkpoints) lacks the "transformer." prefix, as
    transformers' base_model_prefix allows."""
    bare = name.split(".", 1)[-1]
    return bare if name not in index and bare in index else name


def _place(tensor, spec, sharding, row_offset: int | None) -> jax.Array:
    """The param from `tensor` (or from its rows from row_offset on), each device reading its slice."""
    def read(index=None) -> np.ndarray:
        index = index or tuple(slice(None) for _ in spec.shape)
        if row_offset is not None:
            first = slice((index[0].start or 0) + row_offset,
                          (spec.shape[0] if index[0].stop is None else index[0].stop) + row_offset)
            index = (first, *index[1:])
        x = tensor[index]
        if x.dtype.itemsize == 1 and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != spec.dtype:
            raise ValueError(f"a float8 tensor of shape {tensor.get_shape()} in the checkpoint where {spec.dtype} "
                             "is read: fp8 weights are read only with their scales, as the quantized Linear "
                             "weights of a pre-quantized checkpoint (jaxserve/prequantized.py)")
        return x.astype(spec.dtype)

    if sharding is None:
        return jnp.asarray(read())
    return jax.make_array_from_callback(spec.shape, sharding, read)


def _load_orbax(model_dir: str, cfg: ModelConfig, dtype, shardings: Any, quantization: str | None,
                lm_head: bool) -> dict:
    """Restore as written; a checkpoint written unquantized is quantized after restoring."""
    import orbax.checkpoint as ocp

    saved, saved_head = saved_quantization(model_dir), saved_lm_head(model_dir)
    if saved is not None and quantization not in (None, saved):
        raise ValueError(f"{model_dir} holds {saved} weights; it cannot be loaded as {quantization}")
    if saved is not None and lm_head and not saved_head:
        raise ValueError(f"{model_dir} holds {saved} weights and an unquantized LM head; convert it with "
                         "--quantize-lm-head to quantize the head")
    shapes = param_shapes(cfg, dtype, saved, saved_head)
    pending = quantization if saved is None else None
    final_shardings = shardings
    if pending is not None and shardings is not None:
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, spec: _read_sharding(final_shardings, tuple(k.key for k in path),
                                              quant.quantizable(tuple(k.key for k in path), spec, lm_head)), shapes)
    if shardings is None:
        device = jax.devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.abspath(os.path.join(model_dir, ORBAX_DIR)), target)
    return quant.quantize_params(params, pending, final_shardings, lm_head and saved is None)


def _copy_side_files(src: str, dst: str, keep: Callable[[str], bool]) -> None:
    os.makedirs(dst, exist_ok=True)
    for fn in os.listdir(src):
        full = os.path.join(src, fn)
        if os.path.isfile(full) and keep(fn):
            shutil.copy2(full, os.path.join(dst, fn))


def convert_to_orbax(model_dir: str, out_dir: str, dtype=jnp.float32, quantization: str | None = None,
                     lm_head: bool = False) -> str:
    """Write an orbax-checkpoint copy of a HF model directory (config and tokenizer copied
    along), its Linear weights quantized when `quantization` is given (`lm_head`: the head's too)."""
    import orbax.checkpoint as ocp

    cfg = ModelConfig.from_pretrained(model_dir)
    params = load_params(model_dir, cfg, dtype, quantization=quantization, lm_head=lm_head)
    _copy_side_files(model_dir, out_dir, lambda fn: not fn.endswith(".safetensors")
                     and fn not in ("model.safetensors.index.json", QUANTIZATION_FILE))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(out_dir, ORBAX_DIR)), params, force=True)
    with open(os.path.join(out_dir, QUANTIZATION_FILE), "w") as f:
        json.dump({"quantization": quantization or saved_quantization(model_dir),
                   "quantize_lm_head": lm_head or saved_lm_head(model_dir)}, f)
    return out_dir


def save_pretrained(params: dict, hf_config: dict, out_dir: str, dtype=None) -> None:
    """Write params as a Hugging Face model directory (config.json + model.safetensors). MXFP4
    experts (a gpt-oss checkpoint's, as loaded) are written as stored, with MXFP4's
    quantization_config; unquantized weights without one, whatever hf_config says (as transformers
    writes a model it dequantized on loading)."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(hf_config)
    hf_tensor = architecture(cfg.architecture).hf_tensor
    parts: dict[str, list] = {}   # HF name -> [(first row or Interleaved index, array)]: fused tensors in row order
    transposed, interleaved = set(), set()   # HF names: stored_transposed, rows alternating (Interleaved)
    quantized = False   # MXFP4 tensors written
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys, suffix, x = tuple(k.key for k in path), "", np.asarray(leaf)
        if keys[-1] in quant.LEAVES:   # [..., out, ...] as stored, never cast nor transposed
            suffix, x = mxfp4.written(keys[-1], x, quant.node(params, keys[:-1]))
            keys, quantized = quant.weight_keys(keys), True
        elif dtype is not None:
            x = x.astype(dtype)
        name, rows = hf_tensor(keys, cfg)
        name = tuple(n + suffix for n in name) if isinstance(name, tuple) else name + suffix
        if stored_transposed(cfg, keys, np.ndim(leaf)) and not suffix:
            transposed.add(name)
        if isinstance(rows, Interleaved):
            interleaved.add(name)
        for one, y in zip(name, x) if isinstance(name, tuple) else [(name, x)]:   # a stack: a tensor each
            first = rows.index if isinstance(rows, Interleaved) else 0 if rows is None else rows[0]
            parts.setdefault(one, []).append((first, y))

    def join(name: str, xs: list[np.ndarray]) -> np.ndarray:   # [experts, rows, ...] each: their rows in turn
        return np.stack(xs, axis=2).reshape(*xs[0].shape[:1], -1, *xs[0].shape[2:]) if name in interleaved \
            else np.concatenate(xs)
    tensors = {name: join(name, [x for _, x in sorted(p, key=lambda r: r[0])]) for name, p in parts.items()}
    tensors = {name: np.ascontiguousarray(np.swapaxes(x, -1, -2) if name in transposed else x)
               for name, x in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if quantized:
        config["quantization_config"] = mxfp4.quantization_config(hf_config)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
