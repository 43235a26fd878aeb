"""Quantized Linear weights (jaxserve/quantization.py: int8 / int4 weight-only, w8a8) against a
numpy oracle, and the compiled programs' buffers: no full-precision copy of a weight on CPU or TPU."""
import functools
import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from jaxserve import quantization
from jaxserve.models.layers import Linear


def oracle(w: np.ndarray, mode: str) -> np.ndarray:
    """The dequantized weight, by numpy: round-to-nearest, int8 per output row (levels +-127;
    w8a8's weights too), int4 per 128 inputs (levels +-7), int4_asym per 128 inputs (16 levels from
    the group's minimum to its maximum, or to 0 if 0 is not between them, one level at 0), fp8 per
    128 inputs (e4m3 of the group over its largest magnitude / 448, by ml_dtypes)."""
    w = w.astype(np.float64)
    if mode in ("int8", "w8a8"):
        s = np.abs(w).max(axis=1, keepdims=True) / 127
        return np.clip(np.round(w / s), -127, 127) * s
    g = w.reshape(w.shape[0], -1, 128)
    if mode == "fp8":
        s = np.abs(g).max(axis=2, keepdims=True) / 448
        return ((g / s).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s).reshape(w.shape)
    if mode == "int4":
        s = np.abs(g).max(axis=2, keepdims=True) / 7
        return (np.clip(np.round(g / s), -7, 7) * s).reshape(w.shape)
    low, high = np.minimum(g.min(axis=2, keepdims=True), 0), np.maximum(g.max(axis=2, keepdims=True), 0)
    s = (high - low) / 15
    zero = np.round(-low / s)
    return ((np.clip(np.round(g / s) + zero, 0, 15) - zero) * s).reshape(w.shape)


def leaves(mode):
    """The leaves a quantized Linear holds in `mode`."""
    return {"qweight", quantization.SCALES[mode]} | ({quantization.ZERO} if mode == "int4_asym" else set())


def dequantized(q, mode):
    return np.asarray(quantization.dequantize(q["qweight"], q[quantization.SCALES[mode]], zero=q.get(quantization.ZERO)))


def random_weight(out=256, inp=384, seed=0):
    return np.random.default_rng(seed).normal(size=(out, inp)).astype(np.float32)


@pytest.mark.parametrize("mode", quantization.MODES)
def test_dequantized_weight_matches_numpy_oracle(mode):
    w = random_weight()
    q = quantization.quantize_weight(w, mode)
    bits = 4 if mode.startswith("int4") else 8
    assert q["qweight"].size * q["qweight"].dtype.itemsize * 8 == w.size * bits   # int4: two per byte
    assert set(q) == leaves(mode)
    np.testing.assert_allclose(dequantized(q, mode), oracle(w, mode), rtol=1e-5, atol=1e-5)


def test_int4_rejects_inputs_not_in_groups_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantization.quantize_weight(random_weight(8, 200), "int4")


@pytest.mark.parametrize("mode", quantization.MODES)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)])
def test_linear_multiplies_by_the_dequantized_weight(mode, lead):
    w, bias = random_weight(), np.linspace(-1, 1, 256).astype(np.float32)
    x = np.random.default_rng(1).normal(size=(*lead, 384)).astype(np.float32)
    params = quantization.quantize_params({"proj": {"weight": w, "bias": bias}}, mode)["proj"]
    assert set(params) == leaves(mode) | {"bias"}
    y = Linear(256, True).apply({"params": params}, x)
    if mode == "w8a8":   # each token's activations rounded to +-127 levels of their largest magnitude
        s = np.abs(x).max(axis=-1, keepdims=True) / 127
        x = np.clip(np.round(x / s), -127, 127) * s
    np.testing.assert_allclose(np.asarray(y), x @ oracle(w, mode).T + bias, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["int4", "int4_asym", "fp8"])
def test_group_rows_dot_multiplies_by_the_dequantized_weight(mode):
    """TPU's few-rows formulation (each group's partial product scaled after the dot), run on CPU."""
    w = random_weight()
    x = np.random.default_rng(1).normal(size=(2, 3, 384)).astype(np.float32)
    q = quantization.quantize_weight(w, mode)
    y = quantization._group_rows_dot(jnp.asarray(x), q["qweight"], q["scale"], q.get(quantization.ZERO), jnp.float32)
    np.testing.assert_allclose(np.asarray(y), x @ oracle(w, mode).T, rtol=1e-4, atol=1e-4)


def test_lm_head_and_embeddings_stay_unquantized():
    params = {"model": {"embed_tokens": {"embedding": random_weight()}, "norm": {"weight": np.ones(8)},
                        "layers_0": {"mlp": {"up_proj": {"weight": random_weight()}}}},
              "lm_head": {"weight": random_weight()}}
    q = quantization.quantize_params(params, "int8")
    assert set(q["model"]["layers_0"]["mlp"]["up_proj"]) == {"qweight", "scale"}
    assert q["lm_head"]["weight"] is params["lm_head"]["weight"]
    assert q["model"]["embed_tokens"]["embedding"] is params["model"]["embed_tokens"]["embedding"]
    assert q["model"]["norm"]["weight"] is params["model"]["norm"]["weight"]


@pytest.mark.parametrize("mode", quantization.MODES)
def test_quantize_lm_head_quantizes_an_untied_head_and_copies_a_tied_one(mode):
    embedding, head, up = random_weight(), random_weight(seed=1), random_weight(seed=2)
    untied = quantization.quantize_params({"model": {"embed_tokens": {"embedding": embedding}},
                                           "lm_head": {"weight": head}}, mode, lm_head=True)
    tied = quantization.quantize_params({"model": {"embed_tokens": {"embedding": embedding},
                                                   "up_proj": {"weight": up}}}, mode, lm_head=True)
    for q, w in ((untied, head), (tied, embedding)):   # quantized as any Linear weight (the oracle test above)
        expected = quantization.quantize_weight(w, mode)
        assert q["lm_head"].keys() == expected.keys() == leaves(mode)
        assert all(np.array_equal(q["lm_head"][k], expected[k]) for k in expected)
        assert q["model"]["embed_tokens"]["embedding"] is embedding   # the lookups' table stays as it is
    assert set(tied["model"]["up_proj"]) == leaves(mode)
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization mode"):
        quantization.quantize_params({"lm_head": {"weight": head}}, None, lm_head=True)


@pytest.fixture(scope="module")
def tied_model():
    """The embedded model's config (its head tied to the embeddings), the model, random params of
    its shapes."""
    from jaxserve.config import ModelConfig
    from jaxserve.engine import TINY_MODEL_DIR
    from jaxserve.models import build_model, init_params

    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    assert cfg.tie_word_embeddings
    return cfg, build_model(cfg), init_params(cfg, jax.random.key(0))


@functools.partial(jax.jit, static_argnums=0)
def head_logits(model, params, x):
    return model.apply({"params": params}, x, method=model.logits)


@pytest.mark.parametrize("mode", [None, *quantization.MODES])
def test_tied_model_logits_through_the_quantized_head(mode, tied_model):
    """A tied model's logits of random hidden states against numpy: the embedding table itself
    without a quantized head, with one its copy as the numpy oracle rounds it (w8a8: and each
    token's activations rounded to 255 levels). XLA divides by a scale as x * (1 / scale), so a
    value within a float32 ulp of a rounding midpoint may land one level from numpy's: a few in
    a million random values (the trained weights of the embedded model hold few distinct values,
    many on a midpoint, hence random weights of its shapes)."""
    cfg, model, params = tied_model
    table = np.asarray(params["model"]["embed_tokens"]["embedding"])
    q = quantization.quantize_params(params, mode, lm_head=mode is not None)
    x = np.random.default_rng(3).normal(size=(5, cfg.hidden_size)).astype(np.float32)
    logits = np.asarray(head_logits(model, q, x))
    w = table
    if mode is not None:
        w = dequantized(q["lm_head"], mode)
        # fp8's widest step: 32 (between e4m3's 416 and 448) of 448
        expected, step = oracle(table, mode), np.abs(table).max() / {"int4": 7, "int4_asym": 7.5, "fp8": 14}.get(mode, 127)
        off = np.abs(w - expected) > 1e-6
        assert off.sum() <= 1e-5 * table.size and np.all(np.abs(w - expected)[off] < 1.01 * step), off.sum()
    if mode == "w8a8":
        s = np.abs(x).max(axis=-1, keepdims=True) / 127
        x = np.clip(np.round(x / s), -127, 127) * s
    np.testing.assert_allclose(logits, x @ w.T, rtol=1e-4, atol=1e-4)
    if mode is not None:   # the head's rounding shows: the test tells the two tables apart
        assert np.abs(logits - np.asarray(head_logits(model, params, x))).max() > 1e-3


# ---------------------------------------------------------------- compiled buffers

FLOATS = ("f16", "bf16", "f32", "f64")


def materialized_float_sizes(hlo: str, broadcasts: bool = False) -> list[int]:
    """Element counts of the float arrays the program materializes: results of instructions in
    every computation except fused ones (a fusion's insides live in registers or tiles). A
    bitcast is a view, and a broadcast holds no weight values (unless `broadcasts`): XLA TPU
    materializes grouped scales broadcast to the weight's shape in VMEM (memory space S(1), no
    HBM) where the weight is scaled before a dot."""
    fused = set(re.findall(r"fusion\(.*?calls=%?([\w.\-]+)", hlo))
    views = "bitcast" if broadcasts else "broadcast|bitcast"
    sizes, skip = [], False
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            skip = header.group(1) in fused
        elif not skip and " = " in line and not re.search(r"[\]}] (" + views + r")\(", line):
            result = line.split(" = ", 1)[1]
            for dtype, dims in re.findall(r"\b(" + "|".join(FLOATS) + r")\[([\d,]*)\]", result.split("(", 1)[0]):
                sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
    return sizes


OUT, IN = 1024, 1024
# A Qwen3-8B MLP projection's weight: XLA TPU keeps a 1024 x 1024 weight's broadcast scales in
# VMEM, and at this size materialized them in HBM (192 MiB of f32) when the scaling ran in f32.
LARGE = (12288, 4096)


def compiled_linear(mode, device, matmul=quantization.matmul, dtype=jnp.float32, tokens=1, shape=(OUT, IN)):
    """The compiled x @ W.T of a quantized weight of `shape` [out, in] for `device`."""
    q = jax.eval_shape(lambda w: quantization.quantize_weight(w, mode), jax.ShapeDtypeStruct(shape, jnp.float32))
    on = SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct((tokens, shape[1]), dtype, sharding=on)] + [
        jax.ShapeDtypeStruct(q[k].shape, q[k].dtype, sharding=on) for k in ("qweight", quantization.SCALES[mode])]
    zero = q.get(quantization.ZERO)
    zero = None if zero is None else jax.ShapeDtypeStruct(zero.shape, zero.dtype, sharding=on)
    return jax.jit(lambda x, qw, s, z: matmul(x, qw, s, dtype, mode == "w8a8", zero=z)).lower(*args, zero).compile()


def assert_no_weight_copy(compiled, dtype, size=OUT * IN):
    largest = max(materialized_float_sizes(compiled.as_text()))
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert largest < size // 2, f"a float buffer of {largest} elements (the weight has {size})"
    assert temp < size * jnp.dtype(dtype).itemsize // 2, f"{temp} bytes of temporaries"


@pytest.mark.parametrize("mode", quantization.MODES)
def test_cpu_step_dequantizes_in_blocks_not_a_weight_copy(mode):
    assert_no_weight_copy(compiled_linear(mode, jax.devices("cpu")[0]), jnp.float32)


def test_cpu_plain_formulation_would_copy_the_weight():
    """Why CPU has its own formulation, and that the check above can fail: XLA CPU converts the
    whole int8 weight to f32 before the dot."""
    compiled = compiled_linear("int8", jax.devices("cpu")[0],
                               matmul=lambda x, qw, s, dtype, _, zero: quantization._dot(x, qw, s, zero, dtype))
    assert max(materialized_float_sizes(compiled.as_text())) == OUT * IN


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_cpu_w8a8_runs_an_int8_dot_of_at_least_two_rows(tokens):
    """w8a8's reason to exist on CPU: an s8 x s8 -> s32 dot, with one token doubled to two rows
    (XLA CPU's one-row int8 dot is the slow path), taken by columns (w @ x.T: [out, rows]) up to
    8 rows (jaxserve/matmul.py)."""
    hlo = compiled_linear("w8a8", jax.devices("cpu")[0], tokens=tokens).as_text()
    dots = re.findall(r"= (s32)\[(\d+),(\d+)\][^ ]* dot\(", hlo)
    rows = str(max(tokens, 2))
    assert dots == [("s32", "1024", rows) if tokens <= 8 else ("s32", rows, "1024")], dots


@pytest.mark.parametrize("mode", quantization.MODES)
@pytest.mark.parametrize("tokens", [1, 64])
def test_tpu_step_dequantizes_inside_the_dot_fusion(mode, tokens):
    tpu = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices[0]
    compiled = compiled_linear(mode, tpu, dtype=jnp.bfloat16, tokens=tokens, shape=LARGE)
    assert "while" not in compiled.as_text()   # the blocked loop is CPU's alone
    assert_no_weight_copy(compiled, jnp.bfloat16, size=LARGE[0] * LARGE[1])


# One grouped mode per generation (suite time); v5e compiles every mode above.
@pytest.mark.parametrize("generation, mode", [("v4:2x2x1", "int4_asym"), ("v5e:2x2", "fp8"),
                                              ("v5p:2x2x1", "int4"), ("v6e:2x2", "fp8")])
def test_tpu_decode_rows_broadcast_no_scales_to_the_weight(generation, mode):
    """At decode rows (up to TPU_GROUP_ROWS) the grouped scales multiply each group's partial
    product, [rows, groups, out], so nothing the weight's size is built, not even the scales
    broadcast to its shape in VMEM that _dot's program builds, at this size too (the bulk of its
    estimated cycles: benchmarks/results/quantization_fp8.md)."""
    tpu = topologies.get_topology_desc(platform="tpu", topology_name=generation).devices[0]
    hlo = compiled_linear(mode, tpu, dtype=jnp.bfloat16, tokens=8).as_text()
    assert max(materialized_float_sizes(hlo, broadcasts=True)) < OUT * IN // 2   # _dot's: OUT * IN
    assert re.search(rf"f32\[8,{IN // 128},{OUT}\]\S* (convolution|fusion)\(", hlo), "no per-group products"
