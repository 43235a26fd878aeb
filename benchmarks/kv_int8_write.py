"""What XLA:TPU does with the page write of an int8 / fp8 KV cache, row by row against whole pages.

`jaxserve check`'s compile (libtpu, compile-only chips, the KV pool the runner would size) of
the largest decode step and the largest prefill step, kv_cache_dtype int8 (or fp8) with pages
of 32 slots, with the page write as the CPU formulates it (each token's slot row scattered:
kv_cache._put_rows) and as TPU now does (whole pages: kv_cache._put_whole_pages). Per step:
temporaries and whole-pool copies (jaxserve/step_cost.py, one layer's pool as check sizes it),
or the compiler's refusal. Models: the embedded tiny model (configs/tiny-cpu.yaml, head_dim 32
stored in 128 lanes) on v5e-1 and v6e-1 (and fp8 on v5e-1); Llama-3-8B (configs/llama3-8b-v6e-1.yaml, 2 of its 32
layers, the pool sized for all 32) on v6e-1.

  python -m benchmarks.kv_int8_write
"""
import dataclasses
import os
import re
from unittest import mock

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax.numpy as jnp

from jaxserve import check, kv_cache, sizing
from jaxserve.buckets import Buckets
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import TINY_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITES = {"rows": kv_cache._put_rows, "whole pages": kv_cache._put_whole_pages}
KV_INT8 = dict(kv_cache_dtype="int8", page_size=32)
KV_FP8 = dict(kv_cache_dtype="fp8", page_size=32)
CI_LAYERS = 2


def targets():
    """(name, engine config, model config, slice), the pools sized for the whole model."""
    tiny = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    for kv, topology in ((KV_INT8, "v5e-1"), (KV_INT8, "v6e-1"), (KV_FP8, "v5e-1")):
        yield "tiny", EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), **kv), tiny, topology
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "llama3-8b-v6e-1.yaml"), **KV_INT8)
    full, tpu = ModelConfig.from_pretrained(os.path.join(ROOT, ecfg.model)), check.tpu_slice("v6e-1")
    ecfg.num_pages = sizing.kv_pool_pages(full, ecfg, jnp.bfloat16, model_axis=1, hbm_bytes=tpu.hbm_bytes,
                                          used_bytes=sizing.weight_bytes_per_chip(full, jnp.bfloat16, 1),
                                          tpu=True, chip="v6e", name="llama3-8b")
    yield f"llama3-8b ({CI_LAYERS} layers)", ecfg, dataclasses.replace(full, num_layers=CI_LAYERS), "v6e-1"


def refusal(error: str) -> str:
    """The temporaries XLA:TPU said the step needs, when that is why it refused."""
    needed = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", error)
    return f"needs {needed.group(1)} of temporaries, {needed.group(2)} HBM" if needed else error[:90]


def main():
    print("| model | KV | chip | pages | step | write | temporaries | whole-pool copies |")
    print("|---|---|---|---:|---|---|---:|---:|")
    for name, ecfg, cfg, topology in targets():
        shapes = check.quick_shapes(Buckets(ecfg).warmup_shapes(False))
        shapes = [shapes[0], shapes[-1]]   # the largest decode and prefill steps
        for write, put in WRITES.items():
            with mock.patch.object(kv_cache, "_put_whole_pages", put):
                report = check.check(ecfg, cfg, check.tpu_slice(topology), model_name=name, dtype=jnp.bfloat16,
                                     shapes=shapes, samplers=False)
            for r in report.results[:-1]:   # the steps (the page copy has no write)
                temp = f"refused: {refusal(r.error)}" if r.error else f"{r.temp_bytes / 2**30:.2f} GiB"
                print(f"| {name} | {ecfg.kv_cache_dtype} | {topology} | {report.num_pages} | {r.name} | {write} | {temp} | "
                      f"{r.whole_pool_copies if r.error is None else '-'} |", flush=True)


if __name__ == "__main__":
    main()
