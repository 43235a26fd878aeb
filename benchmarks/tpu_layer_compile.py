"""Where does XLA:TPU's compile time of a step go, and how does it grow with the decoder layers?
Compiles one warm-up step shape of Llama-3-8B (bf16, shapes only, no weights) cut to N layers for
one v6e chip through libtpu on this CPU, with libtpu's own log of its compile stages on stderr:

    TPU_STDERR_LOG_LEVEL=0 TPU_MIN_LOG_LEVEL=0 python benchmarks/tpu_layer_compile.py 2 prefill-512x2q512 \
        2>&1 | grep "stage duration\|bundle count"

(HLO_PASSES, BACKEND_PASSES, CODE_GENERATION, END_TO_END; the final program's bundle count.)
Results: benchmarks/results/startup.md.
"""
import dataclasses
import os
import sys
import time

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find jaxserve/
from jaxserve.buckets import Buckets  # noqa: E402
from jaxserve.check import check, tpu_slice  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402



def main(layers: int, shape_name: str) -> None:
    ecfg = EngineConfig.from_yaml("configs/llama3-8b-v6e-1.yaml")
    cfg = dataclasses.replace(ModelConfig.from_pretrained(ecfg.model), num_layers=layers, sliding_windows=())
    shapes = [s for s in Buckets(ecfg, 1, "tpu", "pallas_tpu").warmup_shapes(False) if s.name == shape_name]
    if not shapes:
        raise SystemExit(f"no warm-up step shape {shape_name!r} in configs/llama3-8b-v6e-1.yaml")
    t0 = time.perf_counter()
    report = check(ecfg, cfg, tpu_slice("v6e-1"), model_name="llama3-8b", dtype=jnp.bfloat16, shapes=shapes,
                   samplers=False)
    print(f"{layers} layer(s), {shape_name}: " + ", ".join(f"{c.name} {c.seconds:.1f} s{' ' + c.error if c.error else ''}"
                                                        for c in report.results)
          + f"; wall {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
