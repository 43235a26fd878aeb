"""What one engine step asks of an H100's host, read from the compiled program with no GPU: the
kernels it launches and the host round trips it makes.

Compiles the GPU benchmark engine's steps (benchmarks/gpu_engine.py: the 1.1B Llama, its engine
settings) for a compile-only H100 (`jaxserve check`'s), then counts in each step's optimized HLO:
  * kernels launched: fusions and custom calls (the Pallas kernels, cuBLAS), a while loop's body
    times its known trip count, a conditional's branch as it would run;
  * conditionals and while loops without a known trip count: XLA:GPU copies each predicate to
    the host and waits for it (every iteration of such a loop), holding the thread that launched
    the step until the GPU gets there.
A step with conditionals gets two figures: every predicate true / every one false.
An upper bound on launches where XLA:GPU joins kernels into CUDA graphs (command buffers), which
it decides at run time.

  python -m benchmarks.step_launches [--shapes decode-128,prefill-1024x1q512]
Run it in two trees (PYTHONPATH) to compare them.
"""
from __future__ import annotations

import argparse
import os
import re
import tempfile

import jax

from benchmarks.gpu_engine import LLAMA_1B, WORKLOADS
from jaxserve import check
from jaxserve.buckets import Buckets
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.step_cost import parse_hlo

_LAUNCHES = {"fusion", "custom-call"}


def launches(computations: dict, name: str, branch: str) -> tuple[int, int]:
    """(kernels launched, host round trips) of computation `name`; `branch`: which branch of each
    conditional runs ("true" or "false")."""
    kernels = trips = 0
    for i in computations[name]:
        kernels += i.opcode in _LAUNCHES
        if i.opcode == "while":
            count = re.search(r'known_trip_count":\{"n":"(\d+)"', i.line)
            body = launches(computations, re.search(r"body=%?([\w.\-]+)", i.line).group(1), branch)
            n = int(count.group(1)) if count else 1
            kernels, trips = kernels + n * body[0], trips + n * body[1] + (0 if count else n)
        elif i.opcode == "conditional":
            taken = re.search(rf"{branch}_computation=%?([\w.\-]+)", i.line)
            k, t = launches(computations, taken.group(1), branch) if taken else (0, 0)
            kernels, trips = kernels + k, trips + t + 1
    return kernels, trips


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="", help="step shapes by name (default: check's quick shapes)")
    args = p.parse_args()
    model_dir = tempfile.mkdtemp(prefix="jaxserve-1b-config-")
    from transformers import LlamaConfig
    LlamaConfig(**LLAMA_1B, architectures=["LlamaForCausalLM"]).to_json_file(os.path.join(model_dir, "config.json"))
    (_, max_in), (_, max_out), n = WORKLOADS["1b"]
    max_len = max_in + max_out
    ecfg = EngineConfig(model=model_dir, dtype="bfloat16", max_model_len=max_len, page_size=16,
                        num_pages=n * -(-max_len // 16), enable_prefix_caching=False, max_num_seqs=n,
                        max_num_batched_tokens=1024, prefill_chunk_size=512, max_prefill_seqs=1,
                        attention_backend="pallas_gpu", compilation_cache_dir=None)
    shapes = Buckets(ecfg, 1, "gpu").warmup_shapes(False)
    wanted = [s for s in shapes if s.name in args.shapes.split(",")] or check.quick_shapes(shapes)
    texts = {}   # check compiles each step; its texts are kept on the way
    compile_step = check._compile

    def keep_text(name, lower, pool_bytes):
        compiled = lower().compile()
        texts[name] = compiled.as_text()
        return compile_step(name, lambda: _Compiled(compiled), pool_bytes)

    check._compile = keep_text
    check.check(ecfg, ModelConfig.from_pretrained(model_dir), check.gpu_slice("h100"), model_name="1b",
                shapes=wanted, samplers=False)
    print(f"jax {jax.__version__}; 1.1B Llama (16 layers), pallas_gpu, compiled for an H100")
    print("| step | kernels launched | host round trips | while loops |\n|---|---|---|---|")
    for name, text in texts.items():
        if name == "page-copy":
            continue
        computations = parse_hlo(text)
        entry = re.search(r"^ENTRY %?([\w.\-]+)", text, re.M).group(1)
        runs = {branch: launches(computations, entry, branch) for branch in ("true", "false")}
        (taken, trips), (other, _) = runs["true"], runs["false"]
        kernels = str(taken) if taken == other else f"{taken} / {other}"
        loops = sum(i.opcode == "while" for ops in computations.values() for i in ops)
        print(f"| {name} | {kernels} | {trips} | {loops} |")


class _Compiled:
    """Stands for a lowered step: compile() returns the executable compiled already."""
    def __init__(self, compiled):
        self.compiled = compiled

    def compile(self):
        return self.compiled


if __name__ == "__main__":
    main()
