"""Quantized weights through the engine: quality on the embedded model's held-out text, an exact
orbax round trip (`jaxserve convert --quantization`), tensor parallelism on fake devices (an int8
KV cache's scales too), the CLI flag, and the quantized engine step compiled for a real TPU
(libtpu, compile-only)."""
import functools
import json
import os
import subprocess
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import quantization as bench
from jaxserve import LLM, SamplingParams, check, cli
from jaxserve.buckets import Buckets
from jaxserve.checkpoint import load_params
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import TINY_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = dict(max_num_seqs=4, max_model_len=256, kv_cache_mb=8, compilation_cache_dir=None)
PROMPTS = ["The for statement is used to", "A function definition defines", "The import statement"]
# (weight quantization, kv_cache_dtype, mesh)
TP_CASES = [("int8", "auto", {"model": 2}), ("int4", "auto", {"model": 4}), ("w8a8", "auto", {"model": 2}),
            (None, "int8", {"model": 2})]
NEW_TOKENS = 32


def greedy(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


@functools.cache
def quantized_greedy(mode: str | None, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """The embedded model quantized as it loads (mode None: not), with that KV cache: the
    reference of several tests below, one engine per pair in this process."""
    return greedy(LLM(quantization=mode, kv_cache_dtype=kv_cache_dtype, **ENGINE))


def tp_case(mode, kv_cache_dtype, mesh) -> str:
    return f"{mode}/{kv_cache_dtype}@{json.dumps(mesh)}"


def tp_run(mode, kv_cache_dtype, mesh) -> dict:
    """One TP case's greedy tokens, and its KV arrays' sharding specs (every axis: a step's output
    may leave trailing ones out) and per-device shapes, as the steps left them."""
    llm = LLM(quantization=mode, kv_cache_dtype=kv_cache_dtype, mesh=mesh, **ENGINE)
    tokens = greedy(llm)
    layer = llm.llm_engine.runner.kv_cache.layers[0]
    arrays = {name: getattr(layer, name) for name in ("k", "v", "k_scale", "v_scale")}
    return {"tokens": tokens, "kv": {name: [list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec)),
                                            list(x.addressable_shards[0].data.shape)]
                                     for name, x in arrays.items() if x is not None}}


def test_config_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        EngineConfig(quantization="fp4")


def test_cli_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4"])
    assert cli.engine_config(args).quantization == "int4"
    assert cli.build_parser().parse_args(["convert", "a", "b", "--quantization", "int8"]).quantization == "int8"


def test_heldout_perplexity_within_thresholds():
    """int8 and w8a8 within 1% of unquantized, int4 within 5%, on the first 16 held-out windows
    (benchmarks/quantization.py measures all of them)."""
    ppl = bench.heldout_perplexities(max_windows=16)
    assert abs(ppl["int8"] / ppl[None] - 1) < 0.01, ppl
    assert abs(ppl["w8a8"] / ppl[None] - 1) < 0.01, ppl
    assert abs(ppl["int4"] / ppl[None] - 1) < 0.05, ppl


@pytest.mark.parametrize("mode", ["int8", "w8a8"])
def test_8bit_greedy_agrees_with_unquantized(mode):
    prefix, same = bench.agreement(quantized_greedy(None), quantized_greedy(mode))
    assert sum(same) >= 0.9 * NEW_TOKENS * len(PROMPTS), (prefix, same)


def leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("mode", ["int8", "int4", "w8a8"])
def test_convert_quantized_reloads_exactly(tmp_path, mode):
    dst = str(tmp_path / mode)
    assert cli.main(["convert", TINY_MODEL_DIR, dst, "--quantization", mode]) == 0
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    expected, reloaded = leaves(load_params(TINY_MODEL_DIR, cfg, quantization=mode)), leaves(load_params(dst, cfg))
    assert expected.keys() == reloaded.keys() and any(k.endswith("['qweight']") for k in expected)
    for k in expected:
        assert expected[k].dtype == reloaded[k].dtype and np.array_equal(expected[k], reloaded[k]), k
    assert greedy(LLM(model=dst, **ENGINE)) == quantized_greedy(mode)
    other = "int4" if mode == "int8" else "int8"
    with pytest.raises(ValueError, match=f"holds {mode} weights"):
        load_params(dst, cfg, quantization=other)


def test_unquantized_orbax_checkpoint_quantizes_as_it_loads(tmp_path):
    dst = str(tmp_path / "f32")
    assert cli.main(["convert", TINY_MODEL_DIR, dst]) == 0
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    expected, loaded = leaves(load_params(TINY_MODEL_DIR, cfg, quantization="int8")), leaves(
        load_params(dst, cfg, quantization="int8"))
    assert expected.keys() == loaded.keys()
    assert all(np.array_equal(expected[k], loaded[k]) for k in expected)
    # through the engine: restored onto the quantized tree's shardings, then quantized
    assert greedy(LLM(model=dst, quantization="int8", **ENGINE)) == quantized_greedy("int8")


def test_tensor_parallel_greedy_matches_one_device():
    """int8 and w8a8 weights at TP 2, int4 at TP 4 and an int8 KV cache at TP 2 on fake CPU devices
    (tiny model: 8 heads, 2 kv heads, so K/V replicated at TP 4; int4 o_proj has 2 input groups, so
    its scales are replicated at TP 4). One mesh each: the other pairs add engines to compile, not
    layouts. The one-device tokens come from this process (the subprocess keeps its XLA flags,
    adding the fake devices). The int8 cache's scales are split over the KV heads like its pages:
    each device holds its one KV head's pages and scales."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",   # first: XLA stops at conftest's "intra_op_..." word
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 " + os.environ.get("XLA_FLAGS", "")}
    proc = subprocess.run([sys.executable, "-m", "tests.test_quantized_engine"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(TP_CASES)
    for mode, kv_cache_dtype, mesh in TP_CASES:
        assert results[tp_case(mode, kv_cache_dtype, mesh)]["tokens"] == quantized_greedy(mode, kv_cache_dtype), \
            (mode, kv_cache_dtype, mesh)
    kv = results[tp_case(None, "int8", {"model": 2})]["kv"]
    heads = [None, "model", None, None]   # [pages, KV heads, slots or 1, head_dim or scale lanes]
    (k_spec, (pages, *k_shard)), (v_spec, v_shard) = kv["k"], kv["v"]
    assert k_spec == v_spec == heads and k_shard == [1, 16, 32] and v_shard == [pages, *k_shard], kv
    assert kv["k_scale"] == kv["v_scale"] == [heads, [pages, 1, 1, 16]], kv


# An int8 KV cache: pages of 32 slots (whole 32-row int8 tiles, as the TPU kernel's page DMAs need).
# Known defect (benchmarks/results/kv_quantization.md, session 13): its page write makes XLA copy
# the int8 page pools whole, and the prefill step's copies do not fit beside the pool.
KV_INT8_WRITE_COPIES = pytest.mark.xfail(strict=True, reason="the int8 page write relayouts whole page pools: "
                                         "prefill temporaries 18.35G > 15.75G HBM")


@pytest.mark.parametrize("quantized", [dict(quantization="int8"), dict(quantization="int4"), dict(quantization="w8a8"),
                                       pytest.param(dict(kv_cache_dtype="int8", page_size=32), marks=KV_INT8_WRITE_COPIES)],
                         ids=["int8", "int4", "w8a8", "kv-int8"])
def test_quantized_engine_step_compiles_for_tpu(quantized):
    """configs/tiny-cpu.yaml's largest decode step and largest prefill step with quantized
    weights or KV cache, bf16 and the Pallas kernels, for one v5e chip (what `jaxserve check`
    compiles)."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), **quantized)
    shapes = check.quick_shapes(Buckets(ecfg).warmup_shapes(False))
    shapes = [shapes[0], shapes[-1]]
    report = check.check(ecfg, ModelConfig.from_pretrained(TINY_MODEL_DIR), check.tpu_slice("v5e-1"),
                         model_name="tiny", dtype=jnp.bfloat16, shapes=shapes, samplers=False)
    assert [r.error for r in report.results] == [None] * len(report.results)
    assert report.compiles and report.fits
    assert [r.whole_pool_copies for r in report.results] == [0] * len(report.results)


if __name__ == "__main__":   # the TP runs, on the fake devices of this process
    print(json.dumps({tp_case(*case): tp_run(*case) for case in TP_CASES}))
