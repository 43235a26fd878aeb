"""Scale-out: the device mesh and the sharding rules of parameters and the KV cache.

Every run is on a mesh with axes ("data", "seq", "model"); one device is the mesh 1x1x1.
"model" is innermost: tensor parallelism talks every layer, so its groups are neighbouring
devices (the fastest links). Sequence-parallel prefill nests a shard_map manual over "model"
inside one manual over "seq", and jax 0.11 requires nested manual axes in mesh order.
  * "model": tensor parallelism, Megatron layout. q/k/v, gate and up are split over their
    output (heads / ffn) and o and down over their input, so each layer costs two
    all-reduces of the [tokens, hidden] activations and nothing else. A mixture's experts
    split each one's intermediate dim ("expert_mlp") alike, or with expert parallelism
    (EXPERT_PARALLEL_RULES) their expert axis: each device holds whole experts.
  * "seq": sequence-parallel prefill (a long prompt split in chunks across devices).
  * "data": independent replicas (each serves its own batches; nothing shared).

Parameters carry logical axis names, which their family gives by path in the params tree
(jaxserve.models.registry); LOGICAL_RULES maps them to mesh axes. A dim that does not split
evenly is replicated instead: heads are split only in whole heads (num_heads or num_kv_heads
divisible by the "model" size), so with 2 kv heads under TP 4 the k/v projections and the KV
cache are replicated while q, o and the MLP are still split.

Embedding and lm_head are split over the vocabulary, not the hidden size: the logits then
come out split over vocab and one all-gather of [batch, vocab / tp] per device assembles
them (hidden-split would need an all-reduce of the full [batch, vocab] partial sums, twice
the bytes), and a tied embedding needs one layout that serves both the lookup and the
logits. The lookup on a vocab-split table costs one all-reduce of [tokens, hidden] per step
(each device fills the rows it owns, zeros elsewhere), the same as any split table.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxserve import quantization
from jaxserve.config import ModelConfig

MESH_AXES = ("data", "seq", "model")

# Logical axis name -> mesh axis (None = replicated).
LOGICAL_RULES = {
    "vocab": "model",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": None,      # MoE stacks: every device holds every expert, its share of each one's width
    "expert_mlp": "model",
    "router": None,       # a router's output per expert (and DeepSeek's selection bias): every device routes
    "head_dim": None,
    "latent": None,       # DeepSeek's compressed q and KV (models/mla.py): every device holds them whole
    "positions": None,    # a learned position table (GPT-2): every device holds it whole
    "pages": None,
    "page_slots": None,
    "lora_slots": None,   # LoRA stacks (jaxserve/lora.py): split as their base weight, slots and ranks whole
    "lora_rank": None,
}
# A parameter's logical axes come from its family's rules (jaxserve.models.registry).

# Expert parallelism (ModelConfig.expert_parallel, vLLM's --enable-expert-parallel): the stacks split
# on their expert axis, each device holding num_experts / model whole experts. A fine-grained
# expert split by width leaves each device slivers (Qwen3-30B-A3B's 768 at TP 8: 96 columns, under
# one 128-lane TPU tile); whole experts keep each product's full width. It costs no new collective:
# the activations entering an MoE layer are replicated over "model" under TP anyway, so each device
# runs its own experts for the tokens routed to them and the one all-reduce TP pays sums the
# devices' outputs (layers.SparseMoE). Attention, dense MLPs and shared experts stay as TP splits them.
EXPERT_PARALLEL_RULES = {**LOGICAL_RULES, "experts": "model", "expert_mlp": None}

KV_CACHE_AXES = ("pages", "kv_heads", "page_slots", "head_dim")  # the KV layout: jaxserve/kv_cache.py


def make_mesh(mesh_shape: dict[str, int] | None = None, devices=None) -> Mesh:
    """A ("data", "seq", "model") mesh; missing axes are 1. The product must equal
    len(devices); without `devices`, the first that many of jax.devices() are used."""
    shape = {"data": 1, "model": 1, "seq": 1, **(mesh_shape or {})}
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {MESH_AXES}")
    sizes = [int(shape[a]) for a in MESH_AXES]
    devices = list(jax.devices()[:math.prod(sizes)] if devices is None else devices)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices, "
                         f"got {len(devices)}")
    return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def data_submeshes(mesh: Mesh) -> list[Mesh]:
    """One mesh per slice of the "data" axis ("data" = 1 in each): each data-parallel
    replica's devices."""
    return [Mesh(mesh.devices[i:i + 1], MESH_AXES) for i in range(mesh.shape["data"])]


def _leaf_axes(path, leaf, cfg: ModelConfig) -> tuple[str, ...]:
    """A parameter's logical axes; a quantized weight's qweight and scale shard with the weight."""
    from jaxserve.models import registry  # the models import attention, which imports this module

    keys = tuple(getattr(k, "key", str(k)) for k in path)
    if keys[-1] in quantization.LEAVES:
        weight_axes = registry.param_logical_axes(quantization.weight_keys(keys), cfg)
        return quantization.logical_axes(keys[-1], weight_axes, len(leaf.shape))
    return registry.param_logical_axes(keys, cfg)


def param_logical_axes(params_or_shapes, cfg: ModelConfig):
    """The logical axis names of every parameter, as a pytree of tuples shaped like params."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: _leaf_axes(path, leaf, cfg), params_or_shapes)


def _head_counts(cfg: ModelConfig) -> dict[str, int]:
    """How many whole units each logical axis holds (a head dim splits only between heads)."""
    return {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads}


def logical_to_spec(axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh,
                    cfg: ModelConfig) -> P:
    """PartitionSpec for logical `axes`; a dim whose units (or size: an int4 scale's input
    groups) do not divide the mesh axis is replicated, but for experts under expert parallelism:
    a ValueError (replicated, each device would hold every expert whole)."""
    units = _head_counts(cfg)
    rules = EXPERT_PARALLEL_RULES if cfg.expert_parallel else LOGICAL_RULES
    spec = []
    for name, size in zip(axes, shape):
        mesh_axis = rules[name]
        n = mesh.shape[mesh_axis] if mesh_axis else 1
        if name == "experts" and size % n:
            raise ValueError(f"expert parallelism gives each device whole experts: the {size} experts do not "
                             f"divide over the model axis of {n} devices; choose a model axis that divides "
                             f"{size}, or leave enable_expert_parallel off")
        if n == 1 or units.get(name, size) % n or size % n:
            spec.append(None)
        else:
            spec.append(mesh_axis)
    return P(*spec)


def param_shardings(params_or_shapes, mesh: Mesh, cfg: ModelConfig):
    """NamedSharding for every parameter (pass to checkpoint.load_params or jax.device_put)."""
    def one(path, leaf):
        return NamedSharding(mesh, logical_to_spec(_leaf_axes(path, leaf, cfg), leaf.shape, mesh, cfg))
    return jax.tree_util.tree_map_with_path(one, params_or_shapes)


def kv_cache_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """Sharding of one K or V page pool (KV_CACHE_AXES): kv heads over "model", replicated
    when they do not divide the "model" axis size."""
    shape = (0, cfg.num_kv_heads, 0, cfg.head_dim)
    return NamedSharding(mesh, logical_to_spec(KV_CACHE_AXES, shape, mesh, cfg))


def logits_sharding(cfg: ModelConfig, mesh: Mesh) -> NamedSharding:
    """[batch, vocab] logits as the vocab-split lm_head produces them. Constrain the logits to
    this right after the projection: left alone, XLA may all-gather the whole lm_head instead
    of the [batch, vocab / tp] logits when something downstream wants them replicated."""
    vocab = logical_to_spec(("vocab",), (cfg.vocab_size,), mesh, cfg)
    return NamedSharding(mesh, P(None, *vocab))


def platform(mesh: Mesh) -> str:
    """"cpu", "tpu" or "gpu": where the mesh's arrays live (compile-only TPU devices on a CPU
    host included, unlike jax.default_backend())."""
    return mesh.devices.flat[0].platform


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def gather_tokens(x, seq_axis: str, kv_spec: P | None):
    """All-gather new K or V [tokens, kv_heads, head_dim] over `seq_axis`, inside a shard_map
    manual over it (sequence-parallel prefill). When kv heads are split over an automatic axis
    (kv_spec[1], "model"), the gather runs in a nested shard_map manual over that axis too:
    a collective over a manual axis otherwise first replicates its operand over the automatic
    ones, i.e. XLA would all-gather every layer's K/V heads across "model" as well."""
    def gather(a):
        return jax.lax.all_gather(a, seq_axis, axis=0, tiled=True)

    head_axis = kv_spec[1] if kv_spec is not None else None
    if head_axis is None:
        return gather(x)
    spec = P(None, head_axis, None)
    return jax.shard_map(gather, in_specs=spec, out_specs=spec, axis_names={head_axis},
                         check_vma=False)(x)
