"""Pre-quantized Hugging Face checkpoints: compressed-tensors int8 (W8A16) and packed int4 (W4A16),
written by the `compressed-tensors` package and read by transformers on CPU as the reference, and
GPTQ int4 holding the W4A16 checkpoint's codes and scales (so the same reference)."""
import json
import os
import shutil

import jax
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

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=1,   # 5 step shapes
              max_model_len=128, kv_cache_mb=4, compilation_cache_dir=None)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 102, 111, 114], [256, 100, 101, 102]]
NEW_TOKENS = 16


def save_compressed(d, weights, fmt, largest, **model):
    """A random Llama, every Linear but lm_head quantized by `weights` (scale: each channel's or
    group's largest magnitude / `largest`), saved by compressed-tensors in format `fmt`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    model = save_engine_model(d, seed=3, **model)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                groups = module.weight.reshape(*module.weight_scale.shape, -1)
                module.weight_scale.copy_(groups.abs().amax(dim=-1) / largest)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(d)
    return d


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory):
    """int8 per channel (scale amax / 127), compressed-tensors' int-quantized format."""
    from compressed_tensors.quantization import QuantizationArgs
    return save_compressed(str(tmp_path_factory.mktemp("w8a16")), QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized", 127)


@pytest.fixture(scope="module")
def packed_dir(tmp_path_factory):
    """int4 in groups of 128 inputs, compressed-tensors' pack-quantized format. Scales amax / 7.5
    give codes from -8 (a group's most negative value rounds to it) to 7 (its largest, clamped)."""
    from compressed_tensors.quantization import QuantizationArgs
    return save_compressed(str(tmp_path_factory.mktemp("w4a16")), QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=128), "pack-quantized", 7.5,
        hidden_size=128, intermediate_size=256)


def gptq_pack(values, axis):
    """4-bit values 0..15 as GPTQ's int32 words: 8 consecutive values along `axis` per word,
    value j of a word in bits 4j..4j+3 (AutoGPTQ's QuantLinear.pack)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8) << (4 * np.arange(8, dtype=np.uint32))
    return np.ascontiguousarray(np.moveaxis(np.bitwise_or.reduce(v, axis=-1), -1, axis)).view(np.int32)


@pytest.fixture(scope="module")
def gptq_dir(packed_dir, tmp_path_factory):
    """The W4A16 checkpoint's codes and scales as a GPTQ checkpoint (4 bits, sym, group 128, no
    act-order, the original format: zero points stored as 8 - 1). Its codes are unpacked by
    compressed-tensors itself."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    d = tmp_path_factory.mktemp("gptq")
    tensors = {}
    for name, x in load_file(os.path.join(packed_dir, "model.safetensors")).items():
        if not name.endswith("weight_packed"):
            if not name.endswith(("weight_scale", "weight_shape")):
                tensors[name] = x.numpy()
            continue
        base = name.removesuffix("weight_packed")
        shape = load_file(os.path.join(packed_dir, "model.safetensors"))[base + "weight_shape"]
        codes = unpack_from_int32(x, 4, torch.Size(shape.tolist())).numpy()   # [out, in], -8..7
        scale = load_file(os.path.join(packed_dir, "model.safetensors"))[base + "weight_scale"].numpy()
        out, inp = codes.shape
        tensors[base + "qweight"] = gptq_pack(codes.T + 8, axis=0)
        tensors[base + "scales"] = np.ascontiguousarray(scale.T)
        tensors[base + "qzeros"] = gptq_pack(np.full((inp // 128, out), 7), axis=1)
        tensors[base + "g_idx"] = (np.arange(inp) // 128).astype(np.int32)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(open(os.path.join(packed_dir, "config.json")).read())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                     "sym": True, "checkpoint_format": "gptq"}
    (d / "config.json").write_text(json.dumps(config))
    for fn in os.listdir(packed_dir):
        if fn.startswith("tokenizer") or fn.endswith(".model"):
            shutil.copy(os.path.join(packed_dir, fn), d / fn)
    return str(d)


def reference(model_dir):
    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_loads_int8_as_stored_and_logits_match_transformers(compressed_dir):
    cfg = ModelConfig.from_pretrained(compressed_dir)
    params = load_params(compressed_dir, cfg)
    proj = params["model"]["layers_0"]["mlp"]["down_proj"]
    assert proj["qweight"].dtype == np.int8 and proj["scale"].shape == (cfg.hidden_size,)
    assert "weight" in params["lm_head"]
    ids = np.asarray([PROMPTS[1]])
    model = build_model(cfg)
    ours = model.apply({"params": params}, ids, np.arange(ids.shape[1])[None], method=model.forward_logits)
    with torch.no_grad():
        expected = reference(compressed_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fixture", ["packed_dir", "gptq_dir"])
def test_int4_loads_as_stored_and_logits_match_transformers(fixture, packed_dir, request):
    d = request.getfixturevalue(fixture)
    cfg = ModelConfig.from_pretrained(d)
    params = load_params(d, cfg)
    proj = params["model"]["layers_0"]["mlp"]["down_proj"]
    assert proj["qweight"].shape == (cfg.hidden_size, cfg.intermediate_size // 2) and proj["qweight"].dtype == np.uint8
    assert proj["scale"].shape == (cfg.hidden_size, cfg.intermediate_size // 128)
    codes = np.asarray(dequantize(proj["qweight"], np.ones_like(proj["scale"])))
    assert codes.min() == -8 and codes.max() == 7
    ids = np.asarray([PROMPTS[1]])
    model = build_model(cfg)
    ours = model.apply({"params": params}, ids, np.arange(ids.shape[1])[None], method=model.forward_logits)
    with torch.no_grad():
        expected = reference(packed_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


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


def test_engine_serves_gptq_int4_as_transformers_the_same_weights(gptq_dir, packed_dir):
    assert engine_greedy(gptq_dir) == hf_greedy(packed_dir)


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


def test_gptq_variants_not_read_are_refused(gptq_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    def variant(name, tensors=None, **qc):
        d = tmp_path / name
        shutil.copytree(gptq_dir, d)
        config = json.loads((d / "config.json").read_text())
        config["quantization_config"].update(qc)
        (d / "config.json").write_text(json.dumps(config))
        if tensors:
            save_file({**load_file(str(d / "model.safetensors")), **tensors}, str(d / "model.safetensors"))
        return str(d)

    cases = [(variant("awq", quant_method="awq"), "quant_method 'awq'"),
             (variant("act_order", desc_act=True), "desc_act=True"),
             (variant("group_64", group_size=64), "group_size=64"),
             (variant("asym", sym=False), "sym=False"),
             # zero points of 6 written as symmetric: asymmetric weights in disguise
             (variant("zeros", {"model.layers.1.mlp.up_proj.qzeros": np.full((1, 256 // 8), 0x55555555, np.int32)}),
              "up_proj.qzeros holds zero points other than 8")]
    for d, match in cases:
        with pytest.raises(ValueError, match=match):
            load_params(d, ModelConfig.from_pretrained(d))
