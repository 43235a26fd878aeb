"""Quantized weights through the engine: quality on the embedded model's held-out text, an exact
orbax round trip (`jaxserve convert --quantization`), tensor parallelism on fake devices (an int8
KV cache's scales and a quantized LM head's too), the CLI flags, and the quantized engine step
compiled for a real TPU (libtpu, compile-only). A configuration is a mode, or "mode+head" for
the LM head quantized too (benchmarks/quantization.py's names). One compiled forward pass per
configuration (the training script's, no KV cache, one device) gives the perplexity and, as the
model's argmax after each prefix, the greedy tokens that tensor parallelism must reproduce."""
import functools
import json
import os
import subprocess
import sys

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from benchmarks import quantization as bench
from jaxserve import LLM, SamplingParams, check, cli, kv_cache, parallel
from jaxserve.buckets import Buckets
from jaxserve.checkpoint import load_params
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.kv_cache import KVCache
from jaxserve.models import build_model
from jaxserve.tokenizer import load_tokenizer
from tests.conftest import fake_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Small buckets: the prompts are a few tokens. The three prompts prefill in one step and decode
# together to the end, so an engine compiles two step shapes (with max_prefill_seqs 1 it compiled
# four, the prompts admitted and finished a step apart: a TP-4 engine's run 18 s -> 9 s).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=3,
              max_model_len=256, kv_cache_mb=8, compilation_cache_dir=None, step_shapes="largest")
PROMPTS = ["The for statement is used to", "A function definition defines", "The import statement"]
# (weight quantization, kv_cache_dtype, mesh)
# w8a8's Linears shard as in w8a8+head, which adds the tied head's int8 copy; int8's hold the same
# int8 weights with per-channel scales, sharded alike (their `scale` leaf's rule: int4's).
# int4_asym's Linears hold int4's leaves and zero-point offsets sharded as their scales. fp8's hold
# e4m3 weights and int4's grouped scales, at TP 2 split over the input groups where the inputs are
# (o_proj's 2, down_proj's 6: at TP 4 the 6 stay whole). w8a8+head's int8 KV cache: the one-device
# engine of the agreement test below is its oracle (the forward pass has no KV cache).
TP_CASES = [("int4_asym", "auto", {"model": 4}), ("fp8", "auto", {"model": 2}), ("w8a8+head", "int8", {"model": 2})]
NEW_TOKENS = 32


def greedy(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                       use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


@functools.cache
def quantized_engine(config: str | None, kv_cache_dtype: str) -> LLM:
    """The embedded model quantized as it loads (None: not), with that KV cache: one engine per
    pair in this process (no default: a call that left it out would build a second one)."""
    return LLM(**bench.settings(config), kv_cache_dtype=kv_cache_dtype, **ENGINE)


@functools.cache
def quantized_greedy(config: str | None, kv_cache_dtype: str) -> list[list[int]]:
    """The reference tokens of several tests below."""
    return greedy(quantized_engine(config, kv_cache_dtype))


CFG = ModelConfig.from_pretrained(TINY_MODEL_DIR)
MODEL = build_model(CFG)
WINDOWS, SEQ_LEN = 16, 128   # the held-out windows the perplexity test reads: the forward pass's rows


@jax.jit
def forward(params, tokens):
    """Of each row of tokens [WINDOWS, SEQ_LEN + 1]: the mean next-token loss (the training
    script's row_losses) and the argmax after each token."""
    inputs = tokens[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    logits = MODEL.apply({"params": params}, inputs, positions, method=MODEL.forward_logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(axis=1), logits.argmax(-1)


@functools.cache
def model_params(config: str | None) -> dict:
    return bench.quantized(load_params(TINY_MODEL_DIR, CFG) if config is None else model_params(None), config)


def model_greedy(config: str | None, tokens: list[list[int]]) -> list[list[int]]:
    """The model's argmax after each prompt followed by each prefix of its `tokens`: `tokens`
    itself exactly where they are the model's greedy tokens."""
    tokenizer = load_tokenizer(TINY_MODEL_DIR)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    rows = np.zeros((WINDOWS, SEQ_LEN + 1), np.int32)   # the perplexity's windows' shape and dtype: no compilation more
    for row, p, t in zip(rows, prompts, tokens):
        row[:len(p) + len(t)] = p + t
    best = np.asarray(forward(model_params(config), rows)[1])
    return [b[len(p) - 1:len(p) - 1 + len(t)].tolist() for b, p, t in zip(best, prompts, tokens)]


def tp_case(mode, kv_cache_dtype, mesh) -> str:
    return f"{mode}/{kv_cache_dtype}@{json.dumps(mesh)}"


def tp_run(mode, kv_cache_dtype, mesh) -> dict:
    """One TP case's greedy tokens, and its KV arrays' (and a quantized LM head's) sharding specs
    (every axis: a step's output may leave trailing ones out) and per-device shapes, as the steps
    left them."""
    llm = LLM(**bench.settings(mode), kv_cache_dtype=kv_cache_dtype, mesh=mesh, **ENGINE)
    tokens = greedy(llm)
    layer = llm.llm_engine.runner.kv_cache.layers[0]
    arrays = {name: getattr(layer, name) for name in ("k", "v", "k_scale", "v_scale")}
    arrays.update(llm.llm_engine.runner.params.get("lm_head", {}))
    return {"tokens": tokens, "kv": {name: [list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec)),
                                            list(x.addressable_shards[0].data.shape)]
                                     for name, x in arrays.items() if x is not None}}


def test_config_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4"):
        EngineConfig(quantization="fp4")


def test_cli_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "int4"])
    assert cli.engine_config(args).quantization == "int4" and not cli.engine_config(args).quantize_lm_head
    assert cli.build_parser().parse_args(["convert", "a", "b", "--quantization", "int8"]).quantization == "int8"
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--quantization", "w8a8", "--quantize-lm-head"])
    assert cli.engine_config(args).quantize_lm_head
    for command in (["convert", "a", "b"], ["check", "--config", "c", "--topology", "v5e-1"]):
        assert cli.build_parser().parse_args([*command, "--quantize-lm-head"]).quantize_lm_head, command


def test_heldout_perplexity_within_thresholds():
    """int8, fp8 and w8a8 within 1% of unquantized, int4 and int4_asym within 5%, on the first 16 held-out
    windows (benchmarks/quantization.py measures all of them)."""
    ppl = bench.heldout_perplexities(bench.CONFIGS, WINDOWS, SEQ_LEN, lambda p, t: forward(p, t)[0], model_params)
    for config in ("int8", "fp8", "w8a8", "int8+head", "w8a8+head"):
        assert abs(ppl[config] / ppl[None] - 1) < 0.01, (config, ppl)
    assert abs(ppl["int4"] / ppl[None] - 1) < 0.05 and abs(ppl["int4_asym"] / ppl[None] - 1) < 0.05, ppl


# Through the engine, each 8-bit Linear and the int8 head once: w8a8 and int8+head differ from
# these only in the parts the perplexity test above checks. w8a8+head with an int8 KV cache: the
# tensor-parallel test's oracle, its quantized KV cache agreeing too.
@pytest.mark.parametrize("config, kv_cache_dtype", [("int8", "auto"), ("w8a8+head", "int8")])
def test_8bit_greedy_agrees_with_unquantized(config, kv_cache_dtype):
    prefix, same = bench.agreement(quantized_greedy(None, "auto"), quantized_greedy(config, kv_cache_dtype))
    assert sum(same) >= 0.9 * NEW_TOKENS * len(PROMPTS), (prefix, same)


def test_lm_head_stays_in_the_model_dtype_unless_asked():
    """The embedded model ties its head to the embeddings: by default the logits come from the
    f32 table; with quantize_lm_head from an int8 copy of it, the table kept for the lookups."""
    dtypes = {config: jax.tree.map(lambda x: x.dtype.name, quantized_engine(config, kv).llm_engine.runner.params)
              for config, kv in (("w8a8", "auto"), ("w8a8+head", "int8"))}
    for d in dtypes.values():
        assert d["model"]["embed_tokens"] == {"embedding": "float32"}
        assert d["model"]["layers_0"]["mlp"]["up_proj"] == {"qweight": "int8", "channel_scale": "float32"}
    assert "lm_head" not in dtypes["w8a8"]
    assert dtypes["w8a8+head"]["lm_head"] == {"qweight": "int8", "channel_scale": "float32"}


def leaves(params):
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def assert_same_leaves(expected: dict, got: dict):
    assert expected.keys() == got.keys()
    for k in expected:
        assert expected[k].dtype == got[k].dtype and np.array_equal(expected[k], got[k]), k


def engine_params(**engine) -> dict:
    """The leaves of the params an engine loads (building it compiles nothing: its steps compile
    on first use, and equal params make the same tokens)."""
    return leaves(LLM(**engine, **ENGINE).llm_engine.runner.params)


# int4_asym: int4's leaves and more; fp8: float8 leaves through orbax
@pytest.mark.parametrize("config", ["int8", "int4_asym", "fp8", "w8a8", "w8a8+head"])
def test_convert_quantized_reloads_exactly(tmp_path, config):
    s = bench.settings(config)
    mode, head = s["quantization"], s["quantize_lm_head"]
    dst = str(tmp_path / config)
    assert cli.main(["convert", TINY_MODEL_DIR, dst, "--quantization", mode] + ["--quantize-lm-head"] * head) == 0
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    expected = leaves(load_params(TINY_MODEL_DIR, cfg, quantization=mode, lm_head=head))
    assert any(k.endswith("['qweight']") for k in expected)
    assert any(k.startswith("['lm_head']") for k in expected) == head
    assert_same_leaves(expected, leaves(load_params(dst, cfg)))
    if config in ("int4_asym", "w8a8+head"):   # the engine's restore of packed nibbles and of a head copy
        assert_same_leaves(expected, engine_params(model=dst))   # (int8 and w8a8: as their leaves)
    other = "int4" if mode == "int8" else "int8"
    with pytest.raises(ValueError, match=f"holds {mode} weights"):
        load_params(dst, cfg, quantization=other)
    if not head:
        with pytest.raises(ValueError, match="unquantized LM head"):
            load_params(dst, cfg, lm_head=True)


def test_unquantized_orbax_checkpoint_quantizes_as_it_loads(tmp_path):
    dst = str(tmp_path / "f32")
    assert cli.main(["convert", TINY_MODEL_DIR, dst]) == 0
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    expected = leaves(load_params(TINY_MODEL_DIR, cfg, quantization="int8"))
    assert_same_leaves(expected, leaves(load_params(dst, cfg, quantization="int8")))
    # through the engine: restored onto the quantized tree's shardings, then quantized
    assert_same_leaves(expected, engine_params(model=dst, quantization="int8"))


def test_tensor_parallel_greedy_matches_one_device():
    """int4_asym weights at TP 4, fp8 weights at TP 2 and w8a8+head with an int8 KV cache at TP 2, on
    fake CPU devices (tiny model: 8 heads, 2 kv heads, so K/V replicated at TP 4; int4 o_proj has 2
    input groups, so its scales and zero-point offsets are replicated at TP 4; fp8's are split at
    TP 2). One mesh each: the other pairs add engines to compile, not layouts. The one-device
    tokens come from this process (the subprocess keeps its XLA flags, adding the fake devices):
    the model's greedy tokens by the forward pass, and with the int8 KV cache the engine's. The
    int8 cache's scales are split over the KV heads like its pages: each device holds its one KV
    head's pages and scales."""
    env = fake_devices_env(4)
    proc = subprocess.run([sys.executable, "-m", "tests.test_quantized_engine"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(TP_CASES)
    for mode, kv_cache_dtype, mesh in TP_CASES:
        tokens = results[tp_case(mode, kv_cache_dtype, mesh)]["tokens"]
        one_device = model_greedy(mode, tokens) if kv_cache_dtype == "auto" else quantized_greedy(mode, kv_cache_dtype)
        assert tokens == one_device, (mode, kv_cache_dtype, mesh)
    kv = results[tp_case("w8a8+head", "int8", {"model": 2})]["kv"]
    heads = [None, "model", None, None]   # [pages, KV heads, slots or 1, head_dim or scale lanes]
    (k_spec, (pages, *k_shard)), (v_spec, v_shard) = kv["k"], kv["v"]
    assert k_spec == v_spec == heads and k_shard == [1, 16, 32] and v_shard == [pages, *k_shard], kv
    assert kv["k_scale"] == kv["v_scale"] == [heads, [pages, 1, 1, 16]], kv
    # the tied head's int8 copy: vocab split
    assert kv["qweight"] == [["model", None], [2048, 256]] and kv["channel_scale"] == [["model"], [2048]], kv


# An int8 KV cache: pages of 32 slots (whole 32-row int8 tiles, as the TPU kernel's page DMAs need).
KV_INT8 = dict(kv_cache_dtype="int8", page_size=32)


# Each weight mode and each KV cache dtype once (w8a8 with the head: its Linears as without it).
@pytest.mark.parametrize("quantized", [{**KV_INT8, "quantization": "int8", "kv_cache_dtype": "fp8"},
                                       dict(quantization="int4_asym", **KV_INT8),
                                       dict(quantization="w8a8", quantize_lm_head=True)],
                         ids=["int8-kv-fp8", "int4_asym-kv-int8", "w8a8+head"])
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


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_check_counts_the_copies_of_a_pool_stored_in_padded_lanes(monkeypatch, kv_cache_dtype):
    """The tiny model's head_dim 32 is stored in 128 lanes on TPU: `jaxserve check` must size
    one layer's pool as the compiled program holds it, or its copies go uncounted (it counted 0
    here when it sized the pool from head_dim 32). Copies to count: the 1-byte page written row by
    row on TPU, as the CPU writes it (kv_cache._put_rows; benchmarks/results/kv_quantization.md),
    in the largest decode step (the prefill step's copies do not fit in HBM). fp8's copies went
    uncounted too: step_cost did not read f8e4m3fn[..] as an array."""
    monkeypatch.setattr(kv_cache, "_put_whole_pages", kv_cache._put_rows)
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), kv_cache_dtype=kv_cache_dtype,
                                  page_size=32)
    cfg, tpu = ModelConfig.from_pretrained(TINY_MODEL_DIR), check.tpu_slice("v5e-1")
    report = check.check(ecfg, cfg, tpu, model_name="tiny", dtype=jnp.bfloat16,
                         shapes=check.quick_shapes(Buckets(ecfg).warmup_shapes(False))[:1], samplers=False)
    decode = report.results[0]
    assert decode.error is None and decode.whole_pool_copies >= 2 * cfg.num_layers, decode   # K and V pools
    mesh = parallel.make_mesh({}, tpu.devices[:1])
    kv = KVCache.spec(cfg, mesh, report.num_pages, 32, jnp.bfloat16, kv_cache_dtype)
    assert check.pool_bytes_per_chip(kv) == report.num_pages * cfg.num_kv_heads * 32 * 128


if __name__ == "__main__":   # the TP runs, on the fake devices of this process
    print(json.dumps({tp_case(*case): tp_run(*case) for case in TP_CASES}))
