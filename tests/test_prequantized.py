"""Pre-quantized Hugging Face checkpoints: compressed-tensors int8 (W8A16) and packed int4 (W4A16),
written by the `compressed-tensors` package and read by transformers on CPU as the reference, and
GPTQ int4 holding the W4A16 checkpoint's codes and scales (so the same reference). FP8:
tests/test_prequantized_fp8.py, with the checkpoint writers and comparisons here. The engine serves
the int8 checkpoint as transformers here, and AWQ's Linears (these writers', experts too) in
tests/test_prequantized_moe.py::test_qwen3_moe_awq_loads_experts_as_int4_asym_and_matches_transformers."""
import functools
import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve import LLM, SamplingParams, cli
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.models import build_model
from jaxserve.quantization import dequantize
from tests.hf_models import save_engine_model

# The three prompts prefill in one step and decode together to the end: an engine compiles 2 step
# shapes (one prompt a step: 4, the prompts admitted and finished a step apart).
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=3,
              max_model_len=128, kv_cache_mb=4, compilation_cache_dir=None, step_shapes="largest")
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 102, 111, 114], [256, 100, 101, 102]]
NEW_TOKENS = 16


def save_compressed(d, weights, fmt, activations=None, **model):
    """A random Llama, every Linear but lm_head quantized by `weights` (and its inputs by
    `activations`) and saved by compressed-tensors in format `fmt`. Symmetric scales: a channel's,
    group's, 128x128 block's or the tensor's largest magnitude / 127 (8-bit int), / 448 (e4m3) or
    / 7.5 (4 bits: codes from -8, where the most negative value rounds, to 7, the largest
    clamped); asymmetric: 16 levels from the group's minimum to its maximum (or 0)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    model = save_engine_model(d, seed=3, **model)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)},
        ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                groups = scale_groups(module.weight, module.weight_scale.shape, weights.strategy)
                if weights.symmetric:
                    largest = {(8, "int"): 127, (8, "float"): 448, (4, "int"): 7.5}[weights.num_bits, weights.type]
                    module.weight_scale.copy_(groups.abs().amax(dim=-1) / largest)
                    if activations and not activations.dynamic:   # any static scale: jaxserve leaves it aside
                        module.input_scale.fill_(0.05)
                    continue
                low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
                module.weight_scale.copy_((high - low) / 15)
                module.weight_zero_point.copy_(torch.round(-low / module.weight_scale) - 8)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(d)
    return d


def scale_groups(weight, scale_shape, strategy):
    """The weights each scale stands for, [*scale_shape, n]: a 128x128 block's (the weight padded
    with zeros to whole blocks), else a channel's, a group's or the tensor's."""
    if strategy != "block":
        return weight.reshape(*scale_shape, -1)
    padded = torch.nn.functional.pad(weight, (0, -weight.shape[1] % 128, 0, -weight.shape[0] % 128))
    return padded.reshape(scale_shape[0], 128, scale_shape[1], 128).transpose(1, 2).reshape(*scale_shape, -1)


def int4_args(symmetric):
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=128)


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory):
    """int8 per channel, compressed-tensors' int-quantized format."""
    from compressed_tensors.quantization import QuantizationArgs
    return save_compressed(str(tmp_path_factory.mktemp("w8a16")), QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized")


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    """int4 in groups of 128 inputs, symmetric, compressed-tensors' pack-quantized format."""
    return save_compressed(str(tmp_path_factory.mktemp("w4a16")), int4_args(True), "pack-quantized",
                           hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def asym_dir(tmp_path_factory):
    """int4 in groups of 128 inputs with zero points, compressed-tensors' pack-quantized format."""
    return save_compressed(str(tmp_path_factory.mktemp("w4a16_asym")), int4_args(False), "pack-quantized",
                           hidden_size=128, intermediate_size=256)


def dequantized_copy(src, d, args):
    """src's weights dequantized by compressed-tensors (its unpacking and `dequantize`), as a
    full-precision checkpoint in d: the reference where transformers does not load src as it is
    (packed zero points: it expects them unpacked, a size mismatch) or not weight-only (fp8
    activations, which jaxserve leaves unquantized)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from safetensors.torch import load_file

    model = save_engine_model(d, seed=3, hidden_size=128, intermediate_size=256)
    stored, state = load_file(os.path.join(src, "model.safetensors")), {}
    for name, x in stored.items():
        if name.endswith("weight_packed"):
            base = name.removesuffix("weight_packed")
            out, inp = stored[base + "weight_shape"].tolist()
            zeros = unpack_from_int32(stored[base + "weight_zero_point"], 4, torch.Size([out, inp // 128]), packed_dim=0)
            state[base + "weight"] = ct_dequantize(unpack_from_int32(x, 4, torch.Size([out, inp])),
                                                   stored[base + "weight_scale"], zeros, args)
        elif x.dtype == torch.float8_e4m3fn:
            state[name] = ct_dequantize(x, stored[name + "_scale"], None, args)
        elif not re.search(r"(weight_(scale|shape|zero_point)|input_scale)$", name):
            state[name] = x
    model.load_state_dict(state, strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def asym_float_dir(asym_dir, tmp_path_factory):
    return dequantized_copy(asym_dir, str(tmp_path_factory.mktemp("w4a16_asym_float")), int4_args(False))


def pack_words(values, axis, order=range(8)):
    """4-bit values 0..15 as int32 words of 8 consecutive values along `axis`, bits 4j..4j+3 of
    a word holding its value order[j]: GPTQ's packing (AutoGPTQ's QuantLinear.pack), and AWQ's with
    its order (0, 2, 4, 6, 1, 3, 5, 7) (AutoAWQ's GEMM WQLinear)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)[..., list(order)] << (4 * np.arange(8, dtype=np.uint32))
    return np.ascontiguousarray(np.moveaxis(np.bitwise_or.reduce(v, axis=-1), -1, axis)).view(np.int32)


def gptq(codes, scale, zeros, stored_minus=1):
    """GPTQ's tensors; the original "gptq" format stores zero points minus 1, modulo 16
    ("gptq_v2": stored_minus 0)."""
    return {"qweight": pack_words(codes.T, axis=0), "scales": scale.T,
            "qzeros": pack_words((zeros.T - stored_minus) % 16, axis=1),
            "g_idx": (np.arange(codes.shape[1]) // 128).astype(np.int32)}


def awq(codes, scale, zeros):
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    return {"qweight": pack_words(codes.T, axis=1, order=order), "scales": scale.T,
            "qzeros": pack_words(zeros.T, axis=1, order=order)}


def repack(src, d, write, quantization_config):
    """The pack-quantized checkpoint `src`'s codes, scales and zero points (unpacked by
    compressed-tensors itself: codes and zero points 0..15, weight = scale * (code - zero point))
    written to `d` by `write` as another format's tensors."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    stored = load_file(os.path.join(src, "model.safetensors"))
    tensors = {name: x.numpy() for name, x in stored.items() if not re.search(r"weight_(packed|scale|shape|zero_point)$", name)}
    for name in stored:
        if name.endswith("weight_packed"):
            base = name.removesuffix("weight_packed")
            out, inp = stored[base + "weight_shape"].tolist()
            codes = unpack_from_int32(stored[name], 4, torch.Size([out, inp])).numpy() + 8
            zp = stored.get(base + "weight_zero_point")
            zeros = (np.full((out, inp // 128), 8) if zp is None else
                     unpack_from_int32(zp, 4, torch.Size([out, inp // 128]), packed_dim=0).numpy() + 8)
            scale = stored[base + "weight_scale"].numpy()
            tensors.update({base + k: np.ascontiguousarray(x) for k, x in write(codes, scale, zeros).items()})
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(src, "config.json")).read())
    (pathlib.Path(d) / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    for fn in os.listdir(src):
        if fn.startswith("tokenizer"):
            shutil.copy(os.path.join(src, fn), d)
    return d


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "checkpoint_format": "gptq"}


@pytest.fixture(scope="module")
def gptq_dir(packed_dir, tmp_path_factory):
    return repack(packed_dir, str(tmp_path_factory.mktemp("gptq")), gptq, {**GPTQ, "sym": True})


@pytest.fixture(scope="module")
def gptq_asym_dir(asym_dir, tmp_path_factory):
    return repack(asym_dir, str(tmp_path_factory.mktemp("gptq_asym")), gptq, {**GPTQ, "sym": False})


@pytest.fixture(scope="module")
def gptq_v2_asym_dir(asym_dir, tmp_path_factory):
    return repack(asym_dir, str(tmp_path_factory.mktemp("gptq_v2_asym")), functools.partial(gptq, stored_minus=0),
                  {**GPTQ, "sym": False, "checkpoint_format": "gptq_v2"})


@pytest.fixture(scope="module")
def awq_dir(asym_dir, tmp_path_factory):
    return repack(asym_dir, str(tmp_path_factory.mktemp("awq")), awq, {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"})


def reference(model_dir):
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_loads_int8_as_stored_and_logits_match_transformers(compressed_dir):
    cfg = ModelConfig.from_pretrained(compressed_dir)
    params = load_params(compressed_dir, cfg)
    proj = params["model"]["layers_0"]["mlp"]["down_proj"]
    assert proj["qweight"].dtype == np.int8 and proj["scale"].shape == (cfg.hidden_size,)
    assert "weight" in params["lm_head"]
    assert_logits_match(cfg, params, compressed_dir)


@functools.partial(jax.jit, static_argnums=0)
def forward_logits(model, params, ids):
    """One compilation per model and layout of its weights: the formats read alike share it."""
    return model.apply({"params": params}, ids, jnp.arange(ids.shape[1])[None], method=model.forward_logits)


def assert_logits_match(cfg, params, reference_dir):
    """Our logits of a prompt with `params` are transformers' with `reference_dir`'s model."""
    ids = np.asarray([PROMPTS[1]])
    ours = forward_logits(build_model(cfg), params, ids)
    with torch.no_grad():
        expected = reference(reference_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture, same_weights", [
    ("packed_dir", "packed_dir"), ("gptq_dir", "packed_dir"),
    ("asym_dir", "asym_float_dir"), ("gptq_asym_dir", "asym_float_dir"), ("gptq_v2_asym_dir", "asym_float_dir"),
    ("awq_dir", "asym_float_dir")])
def test_int4_loads_as_stored_and_logits_match_transformers(fixture, same_weights, request):
    d, reference_dir = request.getfixturevalue(fixture), request.getfixturevalue(same_weights)
    cfg = ModelConfig.from_pretrained(d)
    params = load_params(d, cfg)
    proj = params["model"]["layers_0"]["mlp"]["down_proj"]
    assert proj["qweight"].shape == (cfg.hidden_size, cfg.intermediate_size // 2) and proj["qweight"].dtype == np.uint8
    assert proj["scale"].shape == (cfg.hidden_size, cfg.intermediate_size // 128)
    assert ("zero" in proj) == (same_weights == "asym_float_dir")
    codes = np.asarray(dequantize(proj["qweight"], np.ones_like(proj["scale"])))
    assert codes.min() == -8 and codes.max() == 7
    assert_logits_match(cfg, params, reference_dir)


def hf_greedy(model_dir):
    hf = reference(model_dir)
    hf.generation_config.eos_token_id = None
    greedy = tf.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            generation_config=greedy)[0, len(p):].tolist() for p in PROMPTS]


def engine_greedy(model_dir):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in LLM(model=model_dir, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)]


def test_engine_greedy_matches_transformers_and_survives_convert(compressed_dir, tmp_path):
    assert engine_greedy(compressed_dir) == hf_greedy(compressed_dir)
    dst = str(tmp_path / "orbax")   # an orbax copy keeps the stored int8 exactly
    assert cli.main(["convert", compressed_dir, dst]) == 0
    cfg = ModelConfig.from_pretrained(compressed_dir)
    a, b = load_params(compressed_dir, cfg), load_params(dst, cfg)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_unsupported_schemes_are_refused(compressed_dir, tmp_path):
    with open(os.path.join(compressed_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=32)
    d = tmp_path / "grouped"
    shutil.copytree(compressed_dir, d)
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported pre-quantized checkpoint.*8-bit symmetric per-channel"):
        load_params(str(d), ModelConfig.from_pretrained(str(d)))
    with pytest.raises(ValueError, match="holds int8 weights; it cannot be loaded as int4"):
        load_params(compressed_dir, ModelConfig.from_pretrained(compressed_dir), quantization="int4")


def variant(src, d, tensors=None, **qc):
    """A copy of checkpoint `src` in d, its quantization_config updated by qc, `tensors` (torch)
    added to or replacing its own."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, d)
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"].update(qc)
    (d / "config.json").write_text(json.dumps(config))
    if tensors:
        save_file({**load_file(str(d / "model.safetensors")), **tensors}, str(d / "model.safetensors"))
    return str(d)


def assert_refused(cases):
    for d, match in cases:
        with pytest.raises(ValueError, match=match):
            load_params(d, ModelConfig.from_pretrained(d))


def test_gptq_and_awq_variants_not_read_are_refused(gptq_dir, tmp_path):
    def v(name, tensors=None, **qc):
        return variant(gptq_dir, tmp_path / name, tensors, **qc)

    cases = [(v("bnb", quant_method="bitsandbytes"), "quant_method 'bitsandbytes'"),
             (v("act_order", desc_act=True), "desc_act=True"),
             (v("group_64", group_size=64), "group_size=64"),
             (v("bits_8", bits=8), "bits=8"),
             (v("awq_gemv", quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemv"),
              "version='gemv'"),
             # zero points of 6 written as symmetric: asymmetric weights in disguise
             (v("zeros", {"model.layers.1.mlp.up_proj.qzeros": torch.full((1, 256 // 8), 0x55555555, dtype=torch.int32)}),
              "up_proj.qzeros holds zero points other than 8")]
    assert_refused(cases)
