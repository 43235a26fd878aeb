"""A pre-quantized Hugging Face checkpoint: compressed-tensors int8 weight-only (W8A16), written
by the `compressed-tensors` package and read by transformers on CPU as the reference."""
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
from tests.hf_models import save_engine_model

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=1,   # 5 step shapes
              max_model_len=128, kv_cache_mb=4, compilation_cache_dir=None)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 84, 104, 101, 32, 102, 111, 114], [256, 100, 101, 102]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def compressed_dir(tmp_path_factory):
    """A random Llama, every Linear but lm_head int8 per channel (scale amax / 127), saved in
    compressed-tensors' int-quantized format."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)

    d = str(tmp_path_factory.mktemp("w8a16"))
    model = save_engine_model(d, seed=3)
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}, ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                module.weight_scale.copy_(module.weight.abs().amax(dim=1, keepdim=True) / 127)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="int-quantized")
    compressor.compress_model(model)
    model.save_pretrained(d)
    compressor.update_config(d)
    return d


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


def test_engine_greedy_matches_transformers_and_survives_convert(compressed_dir, tmp_path):
    hf = reference(compressed_dir)
    hf.generation_config.eos_token_id = None
    greedy = tf.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                generation_config=greedy)[0, len(p):].tolist() for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in LLM(model=compressed_dir, **ENGINE).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)] == expected
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
