"""Multi-LoRA serving, as vLLM's: PEFT adapters (adapter_config.json + adapter_model.safetensors)
held in fixed device slots, each token of a step applying its own (or none).

Every targeted Linear gets two stacks in the "lora" variable collection beside the params,
A [max_loras, rank, in] and B [out, max_loras, rank], slot s (1..max_loras) at index s - 1 (slot 0,
no adapter, is not stored: its tokens' mask is zero); ranks are zero-padded to max_lora_rank and
each adapter's scaling is folded into its B. layers.Linear adds `delta`, for each token the
product through its slot's A and B. The step gets each token's slot (`StepLora`), so a batch
mixing base rows and rows of several adapters runs in one program, of the same shapes whatever
the mix. The targets are the modules the start-up adapters (lora_modules) target, or
every Linear of the decoder without any; a fused HF tensor (Phi-3's qkv_proj) maps by its rows.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from typing import NamedTuple

import jax
import ml_dtypes
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding

from jaxserve import parallel
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.matmul import matmul_t
from jaxserve.sampling_params import InvalidRequest, LoRARequest

PEFT_PREFIX = "base_model.model."   # PEFT's names: this, the HF module's name, .lora_A.weight / .lora_B.weight


class StepLora(NamedTuple):
    """A step's LoRA input: the slots' stacks (Adapters.weights) and each token's slot [T]."""
    weights: dict
    token_slots: jax.Array

    def variables(self) -> dict:
        """The "lora" collection: each targeted Linear's a, b and the tokens' one-hot slot mask
        [T, max_loras] (all zeros for slot 0)."""
        flat = traverse_util.flatten_dict(self.weights)
        a = next(iter(flat.values()))
        mask = jax.nn.one_hot(self.token_slots - 1, a.shape[0], dtype=a.dtype)   # once for every layer
        flat.update({path[:-1] + ("mask",): mask for path in flat if path[-1] == "a"})
        return traverse_util.unflatten_dict(flat)


def delta(x, a, b, mask):
    """Each token's (x @ A[s].T) @ B[s].T for its slot s: through every slot's A (a few columns
    each), the other slots' columns zeroed by `mask`, then every slot's B, as two products with
    contiguous contractions (matmul_t). Cheaper than gathering each token's matrices (a prefill's
    tokens would copy them) while slots x rank stays small."""
    (slots, rank, inp), out = a.shape, b.shape[0]
    xa = matmul_t(x, a.reshape(slots * rank, inp)).reshape(*x.shape[:-1], slots, rank) * mask[..., None]
    return matmul_t(xa.reshape(*x.shape[:-1], slots * rank), b.reshape(out, slots * rank))


def linear_modules(cfg: ModelConfig) -> dict[tuple[str, ...], tuple[str, tuple[int, int] | None, tuple[int, int]]]:
    """Each Linear of the decoder (not the LM head) by module path: its HF module's name, its rows
    in that tensor (a fused one) or None, its weight's (out, in)."""
    from jaxserve.checkpoint import param_shapes   # the models import layers, which imports this module
    from jaxserve.models.registry import architecture

    if cfg.num_experts:   # PEFT's per-expert adapters would need stacked slots; the router is no target
        raise ValueError(f"LoRA is not supported on mixture-of-experts models ({cfg.architecture}); "
                         "it is supported on the dense families")
    hf_tensor = architecture(cfg.architecture).hf_tensor
    found = {}
    for path, spec in traverse_util.flatten_dict(param_shapes(cfg)).items():
        if path[-1] == "weight" and len(spec.shape) == 2 and "lm_head" not in path:
            name, rows = hf_tensor(path, cfg)
            found[path[:-1]] = (name.removesuffix(".weight"), rows, tuple(spec.shape))
    return found


def read_adapter(path: str, linears: dict, max_rank: int) -> dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]:
    """A PEFT LoRA adapter as {module path: (A [r, in], B [out, r] times its scaling)}, its rank r at
    most max_rank; raises ValueError naming what jaxserve cannot serve."""
    def refuse(why: str):
        raise ValueError(f"LoRA adapter {path}: {why}")

    config_file, weights_file = (os.path.join(path, f) for f in ("adapter_config.json", "adapter_model.safetensors"))
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            refuse(f"no {os.path.basename(f)} (expected a PEFT adapter directory, as save_pretrained writes)")
    with open(config_file) as f:
        cfg = json.load(f)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if cfg.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {cfg['peft_type']!r} is not LORA")
    if not (isinstance(r, int) and r >= 1 and isinstance(alpha, (int, float))):
        refuse(f"adapter_config.json needs an integer r >= 1 and a lora_alpha, got r={r!r}, lora_alpha={alpha!r}")
    if r > max_rank:
        refuse(f"rank {r} is above max_lora_rank {max_rank}; raise max_lora_rank (--max-lora-rank) to at least {r}")
    unsupported = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained modules)",
                   "rank_pattern": "per-module ranks (rank_pattern)",
                   "alpha_pattern": "per-module alphas (alpha_pattern)"}
    for key, what in unsupported.items():
        if cfg.get(key):
            refuse(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        refuse(f"bias {cfg['bias']!r} is not supported (only 'none')")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors, used, adapter = read_safetensors(weights_file), set(), {}
    for module_path, (module, rows, (out, inp)) in linears.items():
        key_a, key_b = (f"{PEFT_PREFIX}{module}.lora_{x}.weight" for x in "AB")
        if key_a not in tensors and key_b not in tensors:
            continue
        if key_a not in tensors or key_b not in tensors:
            refuse(f"{module} has only one of lora_A and lora_B")
        a, b = tensors[key_a], tensors[key_b]
        b = b if rows is None else b[rows[0]:rows[1]]
        if a.shape != (r, inp) or b.shape != (out, r):
            refuse(f"{module}: lora_A {a.shape} and lora_B {b.shape} do not fit the base model's "
                   f"{(out, inp)} weight at rank {r} (an adapter of another model?)")
        used |= {key_a, key_b}
        adapter[module_path] = (a, b * np.float32(scaling))
    if unused := sorted(set(tensors) - used):
        refuse(f"weights jaxserve cannot apply: {unused[:3]} (LoRA applies to the decoder's linear layers, not to "
               f"embeddings or the LM head)")
    if not adapter:
        refuse("no LoRA weights")
    return adapter


def resolve(adapters: "Adapters | None", name: str | None) -> "Adapter | None":
    """A request's adapter (its SamplingParams.lora_name), which the engine must know; None: the base model."""
    if name is None:
        return None
    if adapters is None:
        raise InvalidRequest(f"LoRA adapter {name!r} asked for, but LoRA is not enabled (enable_lora, lora_modules)",
                             param="lora_name")
    adapter = adapters.known.get(name)
    if adapter is None:
        raise InvalidRequest(f"unknown LoRA adapter {name!r} (known: {', '.join(sorted(adapters.known)) or 'none'})",
                             param="lora_name")
    return adapter


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 numpy arrays, bfloat16 ones too (which
    safetensors' numpy reader refuses; its flax reader compiles a conversion per shape)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        data = f.read()
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64}
    tensors = {}
    for name, t in header.items():
        if name != "__metadata__":
            start, end = t["data_offsets"]
            if t["dtype"] not in dtypes:
                raise ValueError(f"{path}: tensor {name} is {t['dtype']}, not a float type")
            tensors[name] = np.frombuffer(data[start:end], dtypes[t["dtype"]]).reshape(t["shape"]).astype(np.float32)
    return tensors


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """An adapter as registered: its name, its directory, its weights as read and checked once
    ({module path: (A [r, in], B [out, r] times its scaling)}, in the slots' dtype) and an id of
    its own. A request holds its Adapter, so it runs on it even if the name is unloaded (or
    loaded again, maybe with other weights: another Adapter) meanwhile; slots and the prefix
    cache tell adapters apart by Adapter, not by name."""
    name: str
    path: str
    weights: dict = dataclasses.field(repr=False)
    id: int = dataclasses.field(default_factory=lambda: next(_adapter_ids))


_adapter_ids = itertools.count(1)


class Adapters:
    """One engine's adapters: which are known by name (`known`), which slot holds which
    (`slot_of`), and the slots' stacks on the device (`weights`, the "lora" collection without
    the masks). The first max_loras lora_modules are loaded at start. Each step, the running
    sequences' adapters (at most max_loras: the scheduler's rule) get slots (`assign`): one not
    resident loads into a free slot, else into the one whose adapter ran least recently (one no
    longer known first). Known adapters' weights stay in host memory."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, mesh, dtype):
        from jaxserve.models.registry import param_logical_axes

        self.max_loras, self.max_rank, self.dtype = ecfg.lora_slots, ecfg.max_lora_rank, dtype
        self.linears = linear_modules(cfg)
        first = {name: read_adapter(path, self.linears, self.max_rank) for name, path in ecfg.lora_modules.items()}
        self.targets = sorted(set().union(*first.values()) if first else self.linears)
        self.known: dict[str, Adapter] = {name: self._adapter(name, ecfg.lora_modules[name], weights)
                                          for name, weights in first.items()}
        shapes, shardings, slots, rank = {}, {}, self.max_loras, self.max_rank
        for path in self.targets:
            out, inp = self.linears[path][2]
            out_axis, in_axis = param_logical_axes(path + ("weight",), cfg)
            for leaf, shape, axes in (("a", (slots, rank, inp), ("lora_slots", "lora_rank", in_axis)),
                                      ("b", (out, slots, rank), (out_axis, "lora_slots", "lora_rank"))):
                shapes[path + (leaf,)] = shape
                shardings[path + (leaf,)] = NamedSharding(mesh, parallel.logical_to_spec(axes, shape, mesh, cfg))
        self.weights = traverse_util.unflatten_dict(
            {p: jax.device_put(np.zeros(s, dtype), shardings[p]) for p, s in shapes.items()})
        # one program for every load: the slot is an argument
        self._store = jax.jit(_store, donate_argnums=0, out_shardings=traverse_util.unflatten_dict(shardings))
        self.slot_of: dict[Adapter, int] = {}        # resident adapters
        self.last_used = [0] * (self.max_loras + 1)  # per slot, the latest `assign` tick its adapter ran in
        self._clock = itertools.count(1)
        for slot, adapter in enumerate(list(self.known.values())[:self.max_loras], 1):
            self._load(adapter, slot)
        if not self.slot_of:   # compile the store now (zeros into slot 1), not at the first load while serving
            self.weights = self._store(self.weights, np.int32(0), self._padded({}))

    def read(self, name: str, path: str) -> Adapter:
        """Adapter `name` from PEFT directory `path`, read and checked (ValueError naming what the
        engine cannot serve), not yet known (`add`)."""
        weights = read_adapter(path, self.linears, self.max_rank)
        if extra := set(weights) - set(self.targets):
            raise InvalidRequest(f"LoRA adapter {name!r} targets {'/'.join(sorted(extra)[0])}, which the engine's "
                                 f"adapters (lora_modules) do not: serve it from the start (lora_modules)",
                                 param="lora_request")
        return self._adapter(name, path, weights)

    def add(self, adapter: Adapter) -> None:
        """Make `adapter` known by its name (a free one)."""
        self.known[adapter.name] = adapter

    def remove(self, name: str) -> None:
        """Forget adapter `name`: new requests cannot ask for it; those holding it run on."""
        del self.known[name]

    def register(self, request: LoRARequest) -> None:
        """Make a LoRARequest's adapter known (read and checked now), unless it already is."""
        known = self.known.get(request.lora_name)
        if known is None:
            self.add(self.read(request.lora_name, request.lora_path))
        elif os.path.abspath(known.path) != os.path.abspath(request.lora_path):
            raise InvalidRequest(f"LoRA adapter {request.lora_name!r} is already {known.path}, not "
                                 f"{request.lora_path}", param="lora_request")

    def assign(self, seqs) -> None:
        """Give each of `seqs` (the running sequences: at most max_loras adapters) its adapter's
        slot, loading adapters that are not resident."""
        running = {s.lora for s in seqs if s.lora is not None}
        tick = next(self._clock)
        for adapter in running:
            if adapter not in self.slot_of:
                self._load(adapter, self._free_slot(running))
            self.last_used[self.slot_of[adapter]] = tick
        for s in seqs:
            s.lora_slot = 0 if s.lora is None else self.slot_of[s.lora]

    def _free_slot(self, running: set) -> int:
        """A free slot, else the one of the adapter not `running` that is no longer known or ran
        least recently (evicted); there is one, as at most max_loras adapters run."""
        holder = {s: a for a, s in self.slot_of.items()}
        free = [s for s in range(1, self.max_loras + 1) if s not in holder]
        if free:
            return free[0]
        _, _, slot = min((self.known.get(a.name) is a, self.last_used[s], s)
                         for s, a in holder.items() if a not in running)
        del self.slot_of[holder[slot]]
        return slot

    def _adapter(self, name: str, path: str, weights: dict) -> Adapter:
        return Adapter(name, path, {p: (a.astype(self.dtype), b.astype(self.dtype)) for p, (a, b) in weights.items()})

    def _load(self, adapter: Adapter, slot: int) -> None:
        self.weights = self._store(self.weights, np.int32(slot - 1), self._padded(adapter.weights))
        self.slot_of[adapter] = slot

    def _padded(self, weights: dict) -> dict:
        """An adapter's {module path: (A, B)} for every target, ranks zero-padded to max_rank;
        zeros where it has none."""
        new = {}
        for path in self.targets:
            out, inp = self.linears[path][2]
            a, b = weights.get(path, (np.zeros((0, inp), self.dtype), np.zeros((out, 0), self.dtype)))
            pad = self.max_rank - a.shape[0]
            new[path] = (np.pad(a, ((0, pad), (0, 0))), np.pad(b, ((0, 0), (0, pad))))
        return new


def _store(weights: dict, index, adapter: dict) -> dict:
    """`weights` with `adapter` ({module path: (A, B)}) at slot index `index`."""
    flat = traverse_util.flatten_dict(weights)
    for path, (a, b) in adapter.items():
        flat[path + ("a",)] = flat[path + ("a",)].at[index].set(a.astype(flat[path + ("a",)].dtype))
        flat[path + ("b",)] = flat[path + ("b",)].at[:, index].set(b.astype(flat[path + ("b",)].dtype))
    return traverse_util.unflatten_dict(flat)
