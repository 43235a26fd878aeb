"""What one quantized Linear costs on TPU by the TPU compiler's own estimate: libtpu compiles
x @ W.T for compile-only devices on this CPU (no TPU attached), and the per-op `estimated_cycles`
of the compiled HLO are summed over the ops outside fusions (no loops here: each op runs once).
Estimated cycles, not a measured time. Old: quantization._dot (each weight scaled by its groups'
scales inside the dot's operand, which XLA:TPU precedes by broadcasting the scales to the weight's
shape); new: quantization.matmul as the engine calls it (_group_rows_dot up to TPU_GROUP_ROWS rows).

    python benchmarks/tpu_grouped_scales.py [--generations v5e,v6e] [--rows 8,32,512] [--shape 12288,4096]
"""
import argparse
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find jaxserve/
from jaxserve import quantization  # noqa: E402

TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
MODES = ("int8", "int4", "int4_asym", "fp8")


def old(x, qweight, scale, zero, dtype):
    return quantization._dot(x.astype(dtype), qweight, scale, zero, dtype)


def new(x, qweight, scale, zero, dtype):
    return quantization.matmul(x, qweight, scale, dtype, zero=zero)


def estimated_cycles(hlo: str) -> int:
    """The summed `estimated_cycles` of the ops outside fusions (a fusion's own figure covers its insides)."""
    assert " while(" not in hlo, "a loop: its body's ops run more than once"
    fused = set(re.findall(r"calls=%?([\w.\-]+)", hlo))
    total, inside = 0, False
    for line in hlo.splitlines():
        if header := re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line):
            inside = header.group(1) in fused
        elif not inside:
            total += sum(int(c) for c in re.findall(r'"estimated_cycles":"(\d+)"', line))
    return total


def linear_cycles(matmul, mode: str, device, rows: int, shape: tuple[int, int]) -> int:
    on = SingleDeviceSharding(device)
    q = jax.eval_shape(lambda w: quantization.quantize_weight(w, mode), jax.ShapeDtypeStruct(shape, jnp.float32))
    leaves = [q["qweight"], q[quantization.SCALES[mode]], q.get(quantization.ZERO)]
    args = [jax.ShapeDtypeStruct((rows, shape[1]), jnp.bfloat16, sharding=on)] + [
        None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on) for a in leaves]
    compiled = jax.jit(lambda x, qw, s, z: matmul(x, qw, s, z, jnp.bfloat16)).lower(*args).compile()
    return estimated_cycles(compiled.as_text())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--generations", default="v5e,v6e")
    p.add_argument("--rows", default="8,32,512")
    p.add_argument("--shape", default="12288,4096", help="the weight's [out, in]")
    args = p.parse_args(argv)
    shape = tuple(int(d) for d in args.shape.split(","))
    print(f"[{shape[0]}, {shape[1]}] weight, bf16 activations; estimated cycles (old -> new)\n")
    print("| generation | weights | " + " | ".join(f"{r} tokens" for r in args.rows.split(",")) + " |")
    print("|---|---|" + "---:|" * len(args.rows.split(",")))
    for gen in args.generations.split(","):
        device = topologies.get_topology_desc(platform="tpu", topology_name=TOPOLOGIES[gen]).devices[0]
        for mode in MODES:
            cells = []
            for rows in map(int, args.rows.split(",")):
                before = linear_cycles(old, mode, device, rows, shape)
                if mode == "int8" or rows > quantization.TPU_GROUP_ROWS:   # the same program
                    cells.append(f"{before:,}")
                    continue
                after = linear_cycles(new, mode, device, rows, shape)
                cells.append(f"{before:,} -> {after:,} ({after / before:.2f}x)")
            print(f"| {gen} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
