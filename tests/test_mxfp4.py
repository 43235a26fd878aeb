"""MXFP4 experts (gpt-oss's Hub checkpoints): jaxserve/mxfp4.py's dequantization against
transformers' own (integrations/mxfp4.py) on random codes and exponents, whole and a slice read
alone, and a gpt-oss checkpoint with MXFP4 experts loading as stored (4.25 bits a weight) to the
logits of transformers, which dequantizes it as it reads it (without a GPU and its kernels: its
fallback); the expert product over MXFP4 leaves: tests/test_quantized_moe.py."""
import json
import os

import jax
import numpy as np
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxserve import mxfp4
from jaxserve.checkpoint import load_params, save_pretrained
from jaxserve.config import ModelConfig
from jaxserve.models import build_model
from tests.hf_models import save_hf_model


def random_mxfp4(rng, *shape: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks and scales of a random MXFP4 tensor [..., out, in]: every code, weights of 2^-6 to 6 * 2^-2."""
    *lead, out, inputs = shape
    return (rng.integers(0, 256, (*lead, out, inputs // mxfp4.BLOCK, 16), dtype=np.uint8),
            rng.integers(121, 126, (*lead, out, inputs // mxfp4.BLOCK), dtype=np.uint8))


def test_dequantization_matches_transformers_and_reads_slices(tmp_path):
    blocks, scales = random_mxfp4(np.random.default_rng(0), 3, 10, 96)
    scales[0, 0] = (1, 127, 252)   # the ends of what float32 holds (6 * 2^125; 255 is NaN)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32).numpy()
    path = str(tmp_path / "w.safetensors")
    save_file({"w_blocks": blocks, "w_scales": scales}, path)
    with safe_open(path, framework="np") as f:
        tensor = mxfp4.Dequantized(f.get_slice("w_blocks"), f.get_slice("w_scales"))
        assert tensor.get_shape() == want.shape == (3, 96, 10)
        np.testing.assert_array_equal(tensor[(slice(None),) * 3], want)
        part = (slice(1, 3), slice(40, 70), slice(3, 7))   # inputs across a block boundary
        np.testing.assert_array_equal(tensor[part], want[part])


def save_mxfp4_gpt_oss(tmp_path) -> tuple[str, dict]:
    """A seeded gpt-oss checkpoint with its experts' weights replaced by random MXFP4 ones (an
    expert width of 64: whole blocks), as the Hub's checkpoints store them; its directory and config."""
    src, dst = str(tmp_path / "f32"), str(tmp_path / "mxfp4")
    save_hf_model("gpt_oss", src, intermediate_size=64)
    rng = np.random.default_rng(1)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, out = tensors.pop(name).shape
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = random_mxfp4(rng, experts, out, inputs)
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)

    return dst, config


def test_mxfp4_checkpoint_loads_as_transformers_reads_it(tmp_path):
    """gpt-oss with MXFP4 experts: the experts kept as their blocks and
    exponents (gate and up de-interleaved), 4.25 bits a weight; our f32 logits within 1e-4 of transformers'."""
    dst, config = save_mxfp4_gpt_oss(tmp_path)
    hf = tf.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    tokens = np.random.RandomState(2).randint(0, config["vocab_size"], (1, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    cfg = ModelConfig.from_pretrained(dst)
    model = build_model(cfg)
    params = load_params(dst, cfg)
    stacks = params["model"]["layers_0"]["mlp"]["experts"]
    assert stacks["gate_proj"]["qweight"].dtype == np.uint8 and stacks["gate_proj"]["scale"].shape == (4, 64, 2)
    weights = sum(2 * stacks[n]["qweight"].size for n in ("gate_proj", "up_proj", "down_proj"))
    assert 8 * sum(stacks[n][k].nbytes for n in ("gate_proj", "up_proj", "down_proj") for k in ("qweight", "scale")) \
        == 4.25 * weights
    ours = np.asarray(model.apply({"params": params}, tokens, np.arange(40)[None], method=model.forward_logits))
    assert np.abs(ours - ref).max() < 1e-4
    assert np.abs(ref).max() > 0.1


def test_save_pretrained_round_trips_mxfp4_and_dequantized_experts(tmp_path):
    """save_pretrained of a gpt-oss loaded from MXFP4 writes the experts as the Hub stores them
    (the same tensors, bit for bit, and MXFP4's quantization_config), which load back to the same
    leaves and to transformers' same logits; its experts dequantized, it writes the unquantized
    tensors and no quantization_config (as transformers writes a model it dequantized on loading),
    which both load to the same logits too."""
    dst, config = save_mxfp4_gpt_oss(tmp_path)
    cfg = ModelConfig.from_pretrained(dst)
    params = load_params(dst, cfg)
    tokens = torch.tensor(np.random.RandomState(2).randint(0, config["vocab_size"], (1, 40)))

    def transformers_logits(d):
        with torch.no_grad():
            return tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()(tokens).logits.numpy()
    ref = transformers_logits(dst)

    kept = str(tmp_path / "kept")
    save_pretrained(params, config, kept)
    with open(os.path.join(kept, "config.json")) as f:
        assert json.load(f)["quantization_config"] == config["quantization_config"]
    want, written = load_file(os.path.join(dst, "model.safetensors")), load_file(os.path.join(kept, "model.safetensors"))
    assert sorted(written) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(written[name], want[name], err_msg=name)
    again = load_params(kept, ModelConfig.from_pretrained(kept))
    jax.tree.map(np.testing.assert_array_equal, again, params)
    np.testing.assert_array_equal(transformers_logits(kept), ref)

    def mxfp4_node(node):
        return isinstance(node, dict) and "qweight" in node
    dense = jax.tree.map(lambda n: mxfp4.dequantize_jnp(n["qweight"], n["scale"], np.float32) if mxfp4_node(n) else n,
                         params, is_leaf=mxfp4_node)
    plain = str(tmp_path / "dequantized")
    save_pretrained(dense, config, plain)
    with open(os.path.join(plain, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    written = load_file(os.path.join(plain, "model.safetensors"))
    assert not any(n.endswith(("_blocks", "_scales")) for n in written) and "model.layers.0.mlp.experts.down_proj" in written
    assert np.abs(transformers_logits(plain) - ref).max() < 1e-5
    jax.tree.map(np.testing.assert_array_equal, load_params(plain, ModelConfig.from_pretrained(plain)), dense)
