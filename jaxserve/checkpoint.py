"""Checkpoints: Hugging Face safetensors <-> the Flax params pytree, and an orbax copy.

Loading reads tensors with safetensors' lazy slices (no PyTorch), renames them to the Flax
tree by the family's name map (jaxserve.models.registry; Linear weights keep PyTorch's
[out, in]; a param held in a fused tensor is a row range of it) and places each one on device. With `shardings` each device reads only its own
slice, so a large model is never whole on one device.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxserve.config import ModelConfig
from jaxserve.models import init_params
from jaxserve.models.registry import architecture

ORBAX_DIR = "orbax"


def param_shapes(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    """The params pytree of `cfg` as ShapeDtypeStructs (no memory allocated)."""
    return jax.eval_shape(lambda key: init_params(cfg, key, dtype), jax.random.key(0))


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


def is_orbax_checkpoint(model_dir: str) -> bool:
    return os.path.isdir(os.path.join(model_dir, ORBAX_DIR))


def load_params(model_dir: str, cfg: ModelConfig, dtype=jnp.float32, shardings: Any = None) -> dict:
    """Load a HF safetensors directory (or one written by `convert_to_orbax`) into params."""
    shapes = param_shapes(cfg, dtype)
    if is_orbax_checkpoint(model_dir):
        return _load_orbax(model_dir, shapes, shardings)
    index = _tensor_index(model_dir)
    hf_tensor = architecture(cfg.architecture).hf_tensor
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    sharding_leaves = (jax.tree_util.tree_leaves(shardings) if shardings is not None
                       else [None] * len(flat))
    open_files: dict[str, Any] = {}
    leaves = []
    try:
        for (path, spec), sharding in zip(flat, sharding_leaves):
            name, rows = hf_tensor(tuple(k.key for k in path), cfg)
            name = _as_in_checkpoint(name, index)
            if name not in index:
                raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r} "
                                 f"(expected shape {tuple(spec.shape)})")
            fn = index[name]
            if fn not in open_files:
                open_files[fn] = safe_open(fn, framework="np")
            tensor = open_files[fn].get_slice(name)
            hf_shape = tuple(tensor.get_shape())
            fits = (hf_shape == tuple(spec.shape) if rows is None
                    else hf_shape[0] >= rows[1] and hf_shape[1:] == tuple(spec.shape[1:]))
            if not fits:
                raise ValueError(f"tensor {name!r} has shape {hf_shape} in the checkpoint, expected "
                                 f"{tuple(spec.shape)}" + ("" if rows is None else f" at rows {rows[0]}:{rows[1]}"))
            leaves.append(_place(tensor, spec, sharding, None if rows is None else rows[0]))
    finally:
        open_files.clear()
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), leaves)


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
        return tensor[index].astype(spec.dtype)

    if sharding is None:
        return jnp.asarray(read())
    return jax.make_array_from_callback(spec.shape, sharding, read)


def _load_orbax(model_dir: str, shapes: dict, shardings: Any) -> dict:
    import orbax.checkpoint as ocp

    if shardings is None:
        device = jax.devices()[0]
        shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device), shapes)
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          shapes, shardings)
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(os.path.abspath(os.path.join(model_dir, ORBAX_DIR)), target)


def _copy_side_files(src: str, dst: str, keep: Callable[[str], bool]) -> None:
    os.makedirs(dst, exist_ok=True)
    for fn in os.listdir(src):
        full = os.path.join(src, fn)
        if os.path.isfile(full) and keep(fn):
            shutil.copy2(full, os.path.join(dst, fn))


def convert_to_orbax(model_dir: str, out_dir: str, dtype=jnp.float32) -> str:
    """Write an orbax-checkpoint copy of a HF model directory (config and tokenizer copied along)."""
    import orbax.checkpoint as ocp

    cfg = ModelConfig.from_pretrained(model_dir)
    params = load_params(model_dir, cfg, dtype)
    _copy_side_files(model_dir, out_dir, lambda fn: not fn.endswith(".safetensors")
                     and fn != "model.safetensors.index.json")
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.abspath(os.path.join(out_dir, ORBAX_DIR)), params, force=True)
    return out_dir


def save_pretrained(params: dict, hf_config: dict, out_dir: str, dtype=None) -> None:
    """Write params as a Hugging Face model directory (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    cfg = ModelConfig.from_hf_dict(hf_config)
    hf_tensor = architecture(cfg.architecture).hf_tensor
    parts: dict[str, list] = {}   # HF name -> [(first row, array)]: fused tensors in row order
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name, rows = hf_tensor(tuple(k.key for k in path), cfg)
        x = np.asarray(leaf)
        parts.setdefault(name, []).append((0 if rows is None else rows[0], x if dtype is None else x.astype(dtype)))
    tensors = {name: np.ascontiguousarray(np.concatenate([x for _, x in sorted(p, key=lambda r: r[0])]))
               for name, p in parts.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
