"""New weights into a running engine, in place: what an RL trainer does between rollouts (vLLM's
`model.load_weights(iterable of (name, tensor))`, sglang's update_weights_from_tensor).

Tensors come by their Hugging Face names, as a checkpoint holds them, and are mapped onto the
params tree by the family's own name map (`hf_tensor`, as checkpoint.load_params reads): a
fused tensor (Phi-3's qkv_proj) fills each param it feeds, a stacked param (a mixture's experts)
takes each expert's tensor in its slice. Any subset may come; the rest stay. Each new leaf is
cast to the engine's dtype, quantized as the engine quantizes (a tied head's quantized copy
follows the embeddings) and placed with the sharding of the leaf it replaces, so every compiled
step takes it as it is: no recompilation.

Everything is checked (names, shapes) before anything is replaced, so a bad update leaves the
engine as it was. Leaves are then replaced one at a time, each old array dropped as its new one is
placed: the update needs room for one tensor beside the model, not a second model.
"""
from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Iterable, NamedTuple

import jax
import numpy as np
from safetensors.numpy import load_file

from jaxserve import quantization as quant
from jaxserve.checkpoint import has_tensor, param_shapes, saved_quantization
from jaxserve.config import ModelConfig
from jaxserve.models.moe import Interleaved
from jaxserve.models.registry import architecture, stored_transposed
from jaxserve.sleep_mode import require_awake


CLASSIFIER = "score.weight"   # a sequence classifier's head


class Target(NamedTuple):
    keys: tuple[str, ...]                  # the param's path in the full-precision tree
    rows: tuple[int, int] | Interleaved | None   # its rows of a fused tensor (every parts-th of each expert's)
    expert: int | None                     # its slice of a stacked param
    shape: tuple[int | None, ...]          # the tensor's (a fused one's first dim: None, at least rows[1])
    dtype: Any
    transposed: bool                       # the tensor is the param's, last two axes swapped (GPT-2's Conv1D)


def targets(cfg: ModelConfig, dtype) -> dict[str, list[Target]]:
    """HF tensor name -> the params it fills (the full-precision tree, as checkpoint.load_params reads)."""
    hf_tensor = architecture(cfg.architecture).hf_tensor
    # A tied model's state dict names its head too (the table again, as transformers ties it)
    out: dict[str, list[Target]] = {"lm_head.weight": []} if cfg.tie_word_embeddings else {}
    for path, spec in jax.tree_util.tree_flatten_with_path(param_shapes(cfg, dtype))[0]:
        keys = tuple(k.key for k in path)
        name, rows = hf_tensor(keys, cfg)
        stacked = isinstance(name, tuple)
        shape = tuple(spec.shape[1:] if stacked else spec.shape)
        if isinstance(rows, Interleaved):   # gpt-oss's gate_up_proj: all of it, the other param's rows too
            shape = (shape[0], shape[1] * rows.parts, *shape[2:])
        elif rows is not None:
            shape = (None, *shape[1:])
        for e, n in enumerate(name if stacked else (name,)):
            out.setdefault(n, []).append(Target(keys, rows, e if stacked else None, shape, spec.dtype,
                                                stored_transposed(cfg, keys, len(spec.shape))))
    # A base model's names lack the first component (BLOOM's "transformer."), as the loader allows
    bare = {n.split(".", 1)[1]: t for n, t in out.items() if "." in n}
    return {**{n: t for n, t in bare.items() if n not in out}, **out}


def checkpoint_tensors(model_dir: str) -> list[tuple[str, np.ndarray]]:
    """Every tensor of a Hugging Face safetensors directory, read on the host."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    try:
        return [item for f in files for item in load_file(f).items()]
    except Exception as e:   # safetensors' own errors: a corrupt file, float8 tensors numpy cannot hold
        raise ValueError(f"cannot read the tensors of {model_dir!r}: {e}") from None


def as_array(tensor):
    """A JAX array as it is (a trainer's, already on the devices: resharded device to device), a
    torch tensor as a numpy array (torch's bfloat16 has no numpy type: as f32), anything else as
    numpy reads it."""
    if isinstance(tensor, jax.Array):
        return tensor
    if hasattr(tensor, "detach"):
        tensor = tensor.detach().cpu()
        return (tensor.float() if str(tensor.dtype) == "torch.bfloat16" else tensor).numpy()
    return np.asarray(tensor)


def check(weights: list[tuple[str, Any]], by_name: dict[str, list[Target]]) -> None:
    for name, tensor in weights:
        if name not in by_name:
            raise ValueError(f"no parameter of this model is loaded from a tensor named {name!r}")
        for t in by_name[name]:
            shape = tuple(np.shape(tensor))
            shape = (*shape[:-2], *shape[-2:][::-1]) if t.transposed else shape
            whole = t.rows is None or isinstance(t.rows, Interleaved)   # the tensor's shape is t.shape
            fits = (shape == t.shape if whole
                    else len(shape) == len(t.shape) and shape[0] >= t.rows[1] and shape[1:] == t.shape[1:])
            if not fits:
                want = t.shape if whole else f"(at least {t.rows[1]}, {', '.join(map(str, t.shape[1:]))})"
                raise ValueError(f"tensor {name!r} has shape {shape}, expected {want}")


def load_weights(params: dict, weights: Iterable[tuple[str, Any]], cfg: ModelConfig, dtype,
                 quantization: str | None) -> int:
    """Replace, in place, the leaves of the engine's `params` (quantized Linears as `quantization`)
    that `weights` name; the number of tensors loaded."""
    weights = list(weights)
    by_name = targets(cfg, dtype)
    check(weights, by_name)
    tied_head = isinstance(params.get(quant.HEAD), dict) and cfg.tie_word_embeddings
    for name, tensor in weights:
        x = as_array(tensor)
        for t in by_name[name]:
            y = x.swapaxes(-1, -2) if t.transposed else x
            if isinstance(t.rows, Interleaved):
                y = y[:, t.rows.index::t.rows.parts]
            elif t.rows is not None:
                y = y[t.rows[0]:t.rows[1]]
            _put(params, t, y.astype(t.dtype), quantization)
            if tied_head and t.keys == quant.TIED_EMBEDDING:   # the head is a quantized copy of the table
                _quantize(params, (quant.HEAD, "weight"), quant.node(params, quant.TIED_EMBEDDING), quantization)
    return len(weights)


def _put(params: dict, t: Target, value, quantization: str | None) -> None:
    parent = quant.node(params, t.keys[:-1])
    if t.keys[-1] == "weight" and "qweight" in parent:   # a quantized Linear (its bias stays beside it)
        _quantize(params, t.keys, jax.device_put(value, parent["qweight"].sharding), quantization)
        return
    old = parent[t.keys[-1]]
    if isinstance(old, dict):   # a quantized stack of experts: the expert's (or every expert's) leaves replaced
        new = quant.quantize_weight(value, quantization)
        quant.set_path(params, t.keys, {k: jax.device_put(new[k] if t.expert is None else v.at[t.expert].set(new[k]),
                                                          v.sharding) for k, v in old.items()})
        return
    new = value if t.expert is None else old.at[t.expert].set(value)
    quant.set_path(params, t.keys, jax.device_put(new, old.sharding))


def _quantize(params: dict, keys: tuple[str, ...], weight, quantization: str) -> None:
    """The quantized Linear at keys[:-1] made from `weight`, placed as the one it replaces."""
    parent = quant.node(params, keys[:-1])
    quant.set_path(params, keys[:-1], quant.quantize_placed(weight, quantization,
                                                            {k: v.sharding for k, v in parent.items()}))


def _split_head(engine, weights: Iterable[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], np.ndarray | None]:
    """An update of `engine` split into the model's tensors and a sequence classifier's new score
    head (applied on the host: jaxserve/pooling.py), or None; ValueError for a head that does not fit."""
    weights, pooler = list(weights), engine.pooler
    if pooler is None or pooler.classifier is None:
        return weights, None
    if not has_tensor(engine.model_dir, CLASSIFIER):
        raise ValueError("this classifier's head was made of LM-head rows (classifier_from_token) as the "
                         "engine started: restart it to serve new weights")
    heads = [np.asarray(as_array(t), np.float32) for n, t in weights if n == CLASSIFIER]
    if heads and heads[-1].shape != pooler.classifier.shape:
        raise ValueError(f"tensor {CLASSIFIER!r} has shape {heads[-1].shape}, expected {pooler.classifier.shape}")
    return [(n, t) for n, t in weights if n != CLASSIFIER], heads[-1] if heads else None


def check_update(engine, weights: Iterable[tuple[str, Any]]) -> None:
    """ValueError for any tensor of an update of `engine` that does not fit (what update_engine
    checks, for a caller that must know before it waits for the engine to be idle)."""
    weights, _ = _split_head(engine, weights)
    check(weights, targets(engine.model_cfg, engine.dtype))


def update_engine(engine, weights: Iterable[tuple[str, Any]]) -> int:
    """`load_weights` into an idle LLMEngine's model (a classifier's score head too), then the
    prefix cache forgotten: its pages hold K/V the old weights computed. Refused while requests
    are in flight (they would finish on a mix of both) and across processes (each host would
    need the tensors), and into weights put to sleep (jaxserve/sleep_mode.py: wake them first).
    The number of tensors loaded."""
    require_awake(engine, "weights")
    if engine.has_unfinished():
        raise RuntimeError(f"{engine.num_requests} request(s) in flight: load weights between batches")
    if jax.process_count() > 1:
        raise ValueError("loading weights into a running engine is for one process; restart a multi-host engine")
    weights, head = _split_head(engine, weights)
    mode = engine.ecfg.quantization or saved_quantization(engine.model_dir)
    loaded = load_weights(engine.runner.params, weights, engine.model_cfg, engine.dtype, mode)
    if head is not None:
        engine.pooler = dataclasses.replace(engine.pooler, classifier=head)
    assert engine.block_manager.reset_prefix_cache()
    return loaded + (head is not None)
