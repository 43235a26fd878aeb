"""Checkpoints: Hugging Face safetensors <-> the Flax params pytree, and an orbax copy.

Loading reads tensors with safetensors' lazy slices (no PyTorch), renames them to the Flax
tree by the family's name map (jaxserve.models.registry; Linear weights keep PyTorch's
[out, in]) and places each one on device. With `shardings` each device reads only its own
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
    hf_name = architecture(cfg.architecture).hf_name
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    sharding_leaves = (jax.tree_util.tree_leaves(shardings) if shardings is not None
                       else [None] * len(flat))
    open_files: dict[str, Any] = {}
    leaves = []
    try:
        for (path, spec), sharding in zip(flat, sharding_leaves):
            keys = tuple(k.key for k in path)
            name = hf_name(keys)
            if name not in index:
                raise ValueError(f"checkpoint {model_dir} is missing tensor {name!r} "
                                 f"(expected shape {tuple(spec.shape)})")
            fn = index[name]
            if fn not in open_files:
                open_files[fn] = safe_open(fn, framework="np")
            tensor = open_files[fn].get_slice(name)
            hf_shape = tuple(tensor.get_shape())
            if hf_shape != tuple(spec.shape):
                raise ValueError(f"tensor {name!r} has shape {hf_shape} in the checkpoint, "
                                 f"expected {tuple(spec.shape)}")
            leaves.append(_place(tensor, spec, sharding))
    finally:
        open_files.clear()
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), leaves)


def _place(tensor, spec, sharding) -> jax.Array:
    def read(index=None) -> np.ndarray:
        return tensor[index or tuple(slice(None) for _ in spec.shape)].astype(spec.dtype)

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
    hf_name = architecture(ModelConfig.from_hf_dict(hf_config).architecture).hf_name
    tensors = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = hf_name(tuple(k.key for k in path))
        x = np.asarray(leaf)
        if dtype is not None:
            x = x.astype(dtype)
        tensors[name] = np.ascontiguousarray(x)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
