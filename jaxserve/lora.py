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

    hf_tensor = architecture(cfg.architecture).hf_tensor
    found = {}
    for path, spec in traverse_util.flatten_dict(param_shapes(cfg)).items():
        if path[-1] == "weight" and len(spec.shape) == 2 and "lm_head" not in path:
            name, rows = hf_tensor(path, cfg)
            found[path[:-1]] = (name.removesuffix(".weight"), rows, tuple(spec.shape))
    return found


def read_adapter(path: str, linears: dict, max_rank: int) -> dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]:
    """A PEFT LoRA adapter as {module path: (A [max_rank, in], B [out, max_rank] times its scaling)};
    raises ValueError naming what jaxserve cannot serve."""
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
        adapter[module_path] = (np.pad(a, ((0, max_rank - r), (0, 0))),
                                np.pad(b * np.float32(scaling), ((0, 0), (0, max_rank - r))))
    if unused := sorted(set(tensors) - used):
        refuse(f"weights jaxserve cannot apply: {unused[:3]} (LoRA applies to the decoder's linear layers, not to "
               f"embeddings or the LM head)")
    if not adapter:
        refuse("no LoRA weights")
    return adapter


def check(adapters: "Adapters | None", name: str | None) -> None:
    """A request's adapter (its SamplingParams.lora_name) is one the engine knows."""
    if name is not None and adapters is None:
        raise InvalidRequest(f"LoRA adapter {name!r} asked for, but LoRA is not enabled (enable_lora, lora_modules)",
                             param="lora_name")
    if name is not None and name not in adapters.paths:
        raise InvalidRequest(f"unknown LoRA adapter {name!r} (known: {', '.join(sorted(adapters.paths)) or 'none'})",
                             param="lora_name")


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


class Adapters:
    """One engine's adapters: which are known (name -> directory), which slot holds which, how
    many running requests use each slot, and the slots' stacks on the device (`weights`, the
    "lora" collection without the masks). lora_modules are loaded at start and stay; another
    adapter loads on demand into a free slot, else the least recently used one no request holds."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, mesh, dtype):
        from jaxserve.models.registry import param_logical_axes

        self.max_loras, self.max_rank = ecfg.lora_slots, ecfg.max_lora_rank
        self.paths = dict(ecfg.lora_modules)
        self.linears = linear_modules(cfg)
        first = {name: read_adapter(path, self.linears, self.max_rank) for name, path in self.paths.items()}
        self.targets = sorted(set().union(*first.values()) if first else self.linears)
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
        self.slot_of: dict[str, int] = {}            # resident adapters
        self.users = [0] * (self.max_loras + 1)      # running requests per slot (index 0, the base model's: unused)
        self.last_used = [0] * (self.max_loras + 1)  # a clock tick per acquire: the least recent is evicted first
        self._clock = itertools.count(1)
        for slot, (name, adapter) in enumerate(first.items(), 1):
            self._load(name, adapter, slot)

    def register(self, request: LoRARequest) -> None:
        """Make an adapter known (checked now, loaded when a request uses it: `acquire`)."""
        known = self.paths.get(request.lora_name)
        if known is not None and os.path.abspath(known) != os.path.abspath(request.lora_path):
            raise InvalidRequest(f"LoRA adapter {request.lora_name!r} is already {known}, not {request.lora_path}",
                                 param="lora_request")
        if known is None:
            self._check_targets(request.lora_name, read_adapter(request.lora_path, self.linears, self.max_rank))
            self.paths[request.lora_name] = request.lora_path

    def acquire(self, name: str | None) -> int:
        """The slot of adapter `name` (0: none) for one more request, loaded into one if need be."""
        if name is None:
            return 0
        if name not in self.slot_of:
            self._load(name, read_adapter(self.paths[name], self.linears, self.max_rank), self._free_slot())
        slot = self.slot_of[name]
        self.users[slot] += 1
        self.last_used[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        if slot:
            self.users[slot] -= 1

    def _free_slot(self) -> int:
        taken = {s: n for n, s in self.slot_of.items()}
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        idle = sorted((self.last_used[s], s) for s in taken if not self.users[s])
        if not (free or idle):
            raise InvalidRequest(f"all {self.max_loras} LoRA slots (max_loras) hold adapters of running requests; "
                                 f"wait for them, or raise max_loras", param="lora_request")
        slot = free[0] if free else idle[0][1]
        if slot in taken:   # evicted
            del self.slot_of[taken[slot]]
        return slot

    def _check_targets(self, name: str, adapter: dict) -> None:
        if extra := set(adapter) - set(self.targets):
            raise InvalidRequest(f"LoRA adapter {name!r} targets {'/'.join(sorted(extra)[0])}, which the engine's "
                                 f"adapters (lora_modules) do not: serve it from the start (lora_modules)",
                                 param="lora_request")

    def _load(self, name: str, adapter: dict, slot: int) -> None:
        self._check_targets(name, adapter)
        new = {}
        for path in self.targets:   # zeros where this adapter has none
            out, inp = self.linears[path][2]
            new[path] = adapter.get(path) or (np.zeros((self.max_rank, inp), np.float32),
                                                        np.zeros((out, self.max_rank), np.float32))
        self.weights = self._store(self.weights, np.int32(slot - 1), new)
        self.slot_of[name] = slot


def _store(weights: dict, index, adapter: dict) -> dict:
    """`weights` with `adapter` ({module path: (A, B)}) at slot index `index`."""
    flat = traverse_util.flatten_dict(weights)
    for path, (a, b) in adapter.items():
        flat[path + ("a",)] = flat[path + ("a",)].at[index].set(a.astype(flat[path + ("a",)].dtype))
        flat[path + ("b",)] = flat[path + ("b",)].at[:, index].set(b.astype(flat[path + ("b",)].dtype))
    return traverse_util.unflatten_dict(flat)
