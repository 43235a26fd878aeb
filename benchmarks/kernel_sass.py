"""Our flash GPU kernel's machine code beside JAX's `attention_mgpu`, without a GPU: each kernel is
compiled for the compile-only H100 (`jaxserve.check.gpu_slice`), Mosaic GPU prints its SASS
(MOSAIC_GPU_DUMP_SASS), and this counts the instructions of each kv loop of the consumer
warpgroups (the loops that hold the wgmma instructions), by opcode. A static view: it says what a
step executes, not how long it waits, so it points at differences for a GPU to time
(benchmarks/kernels.py), it does not replace that.

Shape: causal flash prefill, 4k tokens, heads (32, 8, 128), our bf16 against attention_mgpu's f16
(its own benchmark's config: 64 q rows a warpgroup, kv blocks of 128, 2 buffers).

Needs `make .venv/.compilers` (what `make test` installs): Mosaic GPU runs `nvdisasm` from the
folder of the `ptxas` it uses, where the Makefile puts it. tests/test_gpu_compile.py holds the
FULL-tile loop to what this table shows.

  python -m benchmarks.kernel_sass [--out benchmarks/results/kernel_sass_h100.md]
"""
import argparse
import collections
import os
import re
import subprocess
import sys

from benchmarks.common import markdown_table, write_keeping_notes

CASES = {   # name -> (code run in a fresh process; it compiles one kernel)
    "ours": "gpu.flash_attention(q, k, v, causal=True)",
    "ours (f16)": "gpu.flash_attention(q16, k16, v16, causal=True)",   # attention_mgpu's dtype
    "ours, early K wait": "gpu.flash_attention(q, k, v, causal=True, early_k_wait=True)",
    "jax attention_mgpu (f16)": "attention_mgpu.attention(q16, k16, v16, attention_mgpu.TuningConfig("
                                "block_q=64, block_kv=128, max_concurrent_steps=2, causal=True))",
}
COMPILE = """
import functools, jax, jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention_mgpu
from jaxserve.check import gpu_slice
from pallas_kernels.flash_attention import gpu
attention_mgpu.cuda_versions.cuda_runtime_get_version = lambda: 13000   # its causal check asks the (absent) driver
device = jax.sharding.SingleDeviceSharding(gpu_slice("h100").devices[0])
def spec(heads, dtype):
    return jax.ShapeDtypeStruct((1, 4096, heads, 128), dtype, sharding=device)
def kernel(q, k, v, q16, k16, v16):
    return {call}
args = [spec(h, dt) for dt in (jnp.bfloat16, jnp.float16) for h in (32, 8, 8)]
jax.jit(kernel).lower(*args).compile()
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")


def sass(call: str) -> list[str]:
    """Mosaic GPU's printout of the kernel's SASS, as lines."""
    env = dict(os.environ, MOSAIC_GPU_DUMP_SASS="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", COMPILE.format(call=call)], env=env, capture_output=True,
                          text=True, check=True, cwd=ROOT)
    if "nvdisasm invocation failed" in proc.stdout + proc.stderr:
        raise RuntimeError("nvdisasm not found next to ptxas: see benchmarks/kernel_sass.py")
    return proc.stdout.splitlines()


def kv_loops(lines: list[str]) -> list[collections.Counter]:
    """Opcode counts of each innermost loop (a backward branch) that issues wgmma (HGMMA)."""
    code, labels = [], {}
    for line in lines:
        if m := LABEL.match(line):
            labels[m.group(1)] = len(code)
        elif m := INSTRUCTION.search(line):
            code.append(m.group(2).strip())
    # A loop: a conditional backward branch (an unconditional one returns from an out-of-line
    # barrier-wait retry block to the code that waited)
    loops = []   # (first, last) instruction of each loop that issues wgmma
    for end, text in enumerate(code):
        target = re.search(r"^@!?U?P\w+\s+BRA\S*\s.*?(\.L_x_\d+)", text)
        start = labels.get(target.group(1), end) if target else end
        if start < end and any(t.startswith("HGMMA") for t in code[start:end + 1]):
            loops.append((start, end))
    innermost = [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    opcode = lambda text: re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]  # noqa: E731
    return [collections.Counter(opcode(t) for t in code[s:e + 1]) for s, e in innermost]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the table here (markdown), keeping hand-written notes")
    args = p.parse_args()
    rows = []
    for name, call in CASES.items():
        for i, ops in enumerate(kv_loops(sass(call))):
            count = lambda prefix: sum(n for op, n in ops.items() if op.startswith(prefix))  # noqa: E731
            rows.append([name, f"loop {i + 1}", sum(ops.values()), count("HGMMA"), count("MUFU.EX2"), count("FMNMX"),
                         count("FSEL") + count("SEL"), count("ISETP"), count("SYNCS"), count("LDG")])
    head = ["kernel", "kv loop", "instructions", "HGMMA", "MUFU.EX2", "FMNMX", "SEL/FSEL", "ISETP", "SYNCS", "LDG"]
    table = "\n".join(markdown_table(head, rows, right_aligned=tuple(range(2, len(head)))))
    print(table)
    if args.out:
        write_keeping_notes(args.out, "# Flash kernel kv loops in SASS, compiled for an H100 (no GPU)\n\n"
                            "`python -m benchmarks.kernel_sass`: causal, 4k tokens, heads (32, 8, 128); "
                            "instructions per loop iteration by kind (module docstring).\n\n" + table + "\n")


if __name__ == "__main__":
    main()
