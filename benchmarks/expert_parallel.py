"""One Qwen3-30B-A3B MoE layer (128 experts of 768, top 8, hidden 2048, bf16) compiled for a TPU
slice through libtpu on this CPU (compile-only devices), tensor parallel (each chip a share of
every expert's 768 columns) against expert parallel (each chip 128 / chips whole experts): the
experts' bytes per chip, the grouped products' results (ragged_dot: XLA:TPU's grouped-matmul
kernels; their width is what each chip's kernels run at), the copies of whole stacks XLA:TPU makes
to relayout them for those kernels (experts.py's docstring), the layer's temporaries and its
collectives. The TPU compiler gives no estimated cycles for the grouped kernels (custom calls), so
none are summed here. `--quantization`: the experts quantized in each mode (bf16: not), dequantized
a chunk at a time in the products (jaxserve/models/experts.py).

    python benchmarks/expert_parallel.py [--slices v6e-4,v5e-8] [--tokens 8,64,512] [--quantization bf16,int4]
"""
import argparse
import dataclasses
import itertools
import math
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # beside a `jaxserve check` or a test compiling for TPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find jaxserve/
from jaxserve import check, parallel, quantization  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.models import layers  # noqa: E402

MODEL = "configs/models/qwen3-30b-a3b"
MiB = 1 << 20


def compile_layer(cfg: ModelConfig, mesh, tokens: int, expert_parallel: bool, mode: str = "bf16") -> dict:
    """The layer's experts' bytes on one chip (their scales too), and the compiled layer's grouped
    products, stack copies, temporaries and all-reduces."""
    moe = layers.SparseMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
                           dtype=jnp.bfloat16, mesh=mesh, expert_parallel=expert_parallel)
    x = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.bfloat16, sharding=parallel.replicated(mesh))
    shapes = jax.eval_shape(moe.init, jax.random.key(0), x)
    if mode != "bf16":
        shapes["params"]["experts"] = jax.eval_shape(
            lambda stacks: {k: quantization.quantize_weight(w, mode) for k, w in stacks.items()}, shapes["params"]["experts"])
    shardings = parallel.param_shardings(shapes["params"], mesh, dataclasses.replace(cfg, expert_parallel=expert_parallel))
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, {"params": shardings})
    compiled = jax.jit(moe.apply).lower(params, x).compile()
    hlo = compiled.as_text()
    experts = jax.tree.leaves(params["params"]["experts"])
    return {"expert_bytes": sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in experts),
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "grouped": re.findall(r"%ragged-dot\S* = (\w+\[[\d,]*\])", hlo),
            "copies": re.findall(r"= (\w+\[[\d,]*\])\S* copy\(%param", hlo),
            "all_reduces": re.findall(r"= (\w+\[[\d,]*\])\S* all-reduce\(", hlo)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slices", default="v6e-4,v5e-8")
    p.add_argument("--tokens", default="8,64,512")
    p.add_argument("--quantization", default="bf16", help="the experts' modes, comma-separated (bf16: unquantized)")
    args = p.parse_args(argv)
    cfg = ModelConfig.from_pretrained(MODEL)
    print("| slice | tokens | layout | experts | experts per chip | grouped products | stack copies | temporaries "
          "| all-reduces |")
    print("|---|---:|---|---|---:|---|---|---:|---|")
    for name in args.slices.split(","):
        target = check.tpu_slice(name)
        mesh = parallel.make_mesh({"model": target.chips}, target.devices[:target.chips])
        # one chip: TP and EP are the same layout
        layouts = (False, True) if target.chips > 1 else (False,)
        for tokens, mode, ep in itertools.product(map(int, args.tokens.split(",")), args.quantization.split(","), layouts):
            r = compile_layer(cfg, mesh, tokens, ep, mode)
            print(f"| {name} | {tokens} | {'EP' if ep else 'TP'} | {mode} | {r['expert_bytes'] / MiB:.0f} MiB | "
                  f"{', '.join(sorted(r['grouped']))} | {', '.join(r['copies'])} | {r['temp'] / MiB:.1f} MiB | "
                  f"{', '.join(r['all_reduces'])} |", flush=True)


if __name__ == "__main__":
    main()
