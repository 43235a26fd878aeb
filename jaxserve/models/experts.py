"""A mixture of experts' stacked weights (Experts) and their products: grouped_experts (TPU),
every_expert (CPU, GPU), and in_chunks, which feeds either a quantized stack.

Quantized stacks (jaxserve/quantization.py: int8, int4, fp8; each expert's weight [out, in] as a
Linear's, stacked) are dequantized by in_chunks a chunk of experts at a time, at most
CHUNK_ELEMENTS weights of a projection, as the products consume them: a loop over the chunks, each
chunk's weights dequantized to the model dtype and run through the same grouped_experts or
every_expert as an unquantized stack, the tokens routed elsewhere weighted zero, the chunks'
outputs summed. So no whole stack is ever dequantized: XLA:TPU already copies a whole bf16 stack
for each ragged_dot (the [experts, out, in] layout transposed), and given a whole dequantized
stack it kept that copy, the dequantized one and more (int8 1.5x, int4 3x, fp8 3.5x the bf16
stack's bytes, compiled for v6e). Chunked, a Qwen3-30B-A3B layer at 8 tokens needs 0.6 / 0.7 /
0.8 / 13 MiB of temporaries (int8 / int4 / int4_asym / fp8; benchmarks/results/expert_parallel.md)
where bf16 needs 385; at gpt-oss-120b's shapes (2880 wide) XLA:TPU instead copies each whole
packed stack to the loop's layout before it (int8 3.1 GB, MXFP4 1.9 GB, bf16 2.1 GB), which
storing the stacks [experts, in, out] for TPU would avoid. The
cost: each chunk's grouped product runs over all the rows (the others past its groups), and a
chunk's every_expert is its share of the unchunked one.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxserve import quantization
from jaxserve.matmul import matmul_t

CHUNK_ELEMENTS = 1 << 24   # a projection's weights dequantized at once (32 MiB in bf16)
# Under tensor parallelism each device holds its share of every expert's intermediate dim
# (parallel.LOGICAL_RULES' "expert_mlp"); a quantized stack's scales split with their weight's rows
# (int8's [experts, out] scales) or as its weight (grouped scales [experts, out, in / 128]). Under
# expert parallelism (parallel.EXPERT_PARALLEL_RULES) every leaf splits on its expert axis.
SPLIT = {"gate_proj": P(None, "model", None), "up_proj": P(None, "model", None), "down_proj": P(None, None, "model"),
         "gate_proj_bias": P(None, "model"), "up_proj_bias": P(None, "model")}


class Experts(nn.Module):
    """Every expert's gated-MLP weights stacked [experts, out, in] (Linear's layout) under HF's
    per-expert names: gate_proj, up_proj, down_proj; with `use_bias` their biases [experts, out]
    too (gpt-oss's), as `<name>_bias`. Returns them by name, for grouped_experts or every_expert;
    a quantized stack as its {"qweight", "scale"} (int4_asym's with "zero"), for in_chunks."""
    num_experts: int
    intermediate_size: int
    dtype: jnp.dtype = jnp.float32
    use_bias: bool = False

    @nn.compact
    def __call__(self, hidden_size: int) -> dict:
        init = nn.initializers.lecun_normal(in_axis=-1, out_axis=-2, batch_axis=(0,))
        wide = (self.num_experts, self.intermediate_size, hidden_size)
        narrow = (self.num_experts, hidden_size, self.intermediate_size)
        shapes = {"gate_proj": wide, "up_proj": wide, "down_proj": narrow}
        out = {name: self.stack(name, init, shape) for name, shape in shapes.items()}
        if self.use_bias:
            out.update({f"{name}_bias": self.param(f"{name}_bias", nn.initializers.zeros, shape[:2], self.dtype)
                        for name, shape in shapes.items()})
        return out

    def stack(self, name: str, init, shape: tuple[int, ...]):
        if self.has_variable("params", name) and isinstance(self.get_variable("params", name), Mapping):
            return dict(self.get_variable("params", name))
        return self.param(name, init, shape, self.dtype)


# rows [M, in] sorted by group x weights [G, out, in] -> [M, out], each row by its group's weight
_GROUPED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def grouped_experts(x, weights, chosen, experts: dict, glu):
    """sum_j weights[t, j] * expert chosen[t, j](x[t]) for tokens x [T, hidden]: the T x k
    (token, expert) rows sorted by expert, each projection one grouped product over them
    (jax.lax.ragged_dot: XLA:TPU's grouped-matmul kernels), then put back in token order.
    experts: Experts' weights and the gate and up biases where it has them (the down projection's
    bias is the caller's: SparseMoE adds it once, after the tensor-parallel sum); glu: (gate, up) -> h."""
    k = chosen.shape[-1]
    chosen = chosen.reshape(-1)                  # token t's at t * k ...
    order = jnp.argsort(chosen)                  # stable: each expert's rows in token order
    sizes = jnp.bincount(chosen, length=experts["gate_proj"].shape[0]).astype(jnp.int32)
    rows = x[order // k]

    def grouped(a, name):
        y = jax.lax.ragged_dot_general(a, experts[name], sizes, _GROUPED)
        return y + experts[f"{name}_bias"][chosen[order]] if f"{name}_bias" in experts else y
    h = glu(grouped(rows, "gate_proj"), grouped(rows, "up_proj")) * weights.reshape(-1)[order][:, None]
    return grouped(h, "down_proj")[jnp.argsort(order)].reshape(-1, k, x.shape[-1]).sum(axis=1)


def every_expert(x, weights, chosen, experts: dict, glu):
    """grouped_experts' sum through every expert for every token, the experts a token is not
    routed to weighted zero: E / k times the routed FLOPs, but where XLA has no grouped matmul
    it beats ragged_dot, which then becomes a dense product over the T * k rows masked by expert
    (k times these FLOPs). XLA:CPU also transposes the weights for it every call
    (benchmarks/results/moe_cpu.md: 2.6-19x slower than this on 8 experts of 1024); XLA:GPU (jax
    0.10.2, compile-only H100, Qwen3-30B-A3B's layer) needs 664 MiB / 2.4 GiB of temporaries
    at 64 / 512 tokens where this needs 44 / 352 MiB. Gate and up are one product with all
    experts' rows (matmul_t's contiguous contraction), down one per expert."""
    down = experts["down_proj"]
    num, tokens = down.shape[0], x.shape[0]
    by_expert = (jax.nn.one_hot(chosen, num, dtype=x.dtype) * weights[..., None]).sum(axis=1)   # [T, E]

    def wide(name):   # [E, I, H] -> x's [T, E, I]
        w = experts[name]
        y = matmul_t(x, w.reshape(-1, w.shape[-1])).reshape(tokens, num, -1)
        return y + experts[f"{name}_bias"] if f"{name}_bias" in experts else y
    h = glu(wide("gate_proj"), wide("up_proj")) * by_expert[..., None]
    return jax.lax.dot_general(h, down, (((2,), (2,)), ((1,), (0,)))).sum(axis=0)   # [E, T, H] summed


def in_chunks(path, x, weights, chosen, experts: dict, glu):
    """path (grouped_experts or every_expert) over `experts`, a quantized stack dequantized a
    chunk of experts at a time (the module docstring); unquantized stacks go to path whole.
    Within a chunk, a token's choices of other experts are weighted zero and renumbered past the
    chunk's experts: every_expert's one-hot drops them, grouped_experts sorts them after its
    groups, where ragged_dot's rows belong to no group and are zero."""
    if not any(isinstance(leaf, dict) for leaf in experts.values()):
        return path(x, weights, chosen, experts, glu)
    num, per_expert = experts["gate_proj"]["qweight"].shape[:2]   # per expert: width x hidden weights a projection
    per_expert *= x.shape[-1]
    size = max(c for c in range(1, num + 1) if num % c == 0 and (c == 1 or c * per_expert <= CHUNK_ELEMENTS))

    def chunk(total, first):
        part = jax.tree.map(lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, first, size), experts)
        part = {name: dequantized(leaf, x.dtype) for name, leaf in part.items()}
        y = path(x, *routed_within(weights, chosen, first, size), part, glu)
        return total + y.astype(jnp.float32), None
    total = jnp.zeros(x.shape, jnp.float32)
    return jax.lax.scan(chunk, total, jnp.arange(0, num, size))[0].astype(x.dtype)


def routed_within(weights, chosen, first, size: int):
    """(weights, chosen) of the experts first .. first + size - 1 alone, numbered from 0 (a chunk's,
    or a device's under expert parallelism): a token's choices of other experts weighted zero and
    numbered `size`, past the slice's experts."""
    local = chosen - first
    mine = (local >= 0) & (local < size)
    return jnp.where(mine, weights, 0), jnp.where(mine, local, size)


def dequantized(leaf, dtype):
    """A stack's weights [experts, out, in] in `dtype`: as they are, or dequantized expert by expert."""
    if not isinstance(leaf, dict):
        return leaf
    return jax.vmap(functools.partial(quantization.dequantize, dtype=dtype))(leaf["qweight"], leaf["scale"],
                                                                             zero=leaf.get(quantization.ZERO))


def split_specs(experts: dict, expert_parallel: bool = False) -> dict:
    """shard_map's in_specs of Experts' params (SPLIT; a quantized stack's leaves by their rank), or
    with `expert_parallel` each leaf's expert axis."""
    if expert_parallel:
        return jax.tree.map(lambda _: P("model"), experts)

    def spec(name, leaf):
        if not isinstance(leaf, dict):
            return SPLIT[name]
        return {k: SPLIT[name] if v.ndim == 3 else P(*SPLIT[name][:2]) for k, v in leaf.items()}
    return {name: spec(name, leaf) for name, leaf in experts.items()}


def splits(experts: dict, tp: int, expert_parallel: bool = False) -> bool:
    """Whether every leaf of `experts` divides as split_specs splits it over `tp` devices (a
    grouped scale's input groups too)."""
    leaves = jax.tree.leaves(experts)
    specs = jax.tree.leaves(split_specs(experts, expert_parallel), is_leaf=lambda s: isinstance(s, P))
    return all(size % tp == 0 for leaf, spec in zip(leaves, specs)
               for size, axis in zip(leaf.shape, spec) if axis == "model")
