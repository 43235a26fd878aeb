"""Pre-quantized mixture-of-experts checkpoints: a seeded DeepSeek-V3 written in DeepSeek's and
Qwen's block-FP8 format (every expert's, the shared expert's, the dense MLP's and the latent
attention's projections, kv_b_proj among them, e4m3 in 128x128 blocks with their
`weight_scale_inv`; the router unquantized), loaded with its experts kept in fp8, against
transformers on the same weights dequantized as the format defines (fp8 times its block's
scale_inv, in f32). transformers 5.24 reading the FP8 files themselves on CPU gives other logits
(4.5 apart at most, where ours and its own on the dequantized weights are 1e-5 apart). The block
writer is tests/test_prequantized_fp8.py's."""
import json
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.models import build_model
from jaxserve.quantization import weight_bytes
from tests.hf_models import save_hf_model
from tests.test_prequantized import reference
from tests.test_prequantized_fp8 import fp8_blocks

# every projection's inputs whole 128-wide blocks: hidden, both latent ranks, 4 heads x 32 values
SHAPES = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, kv_lora_rank=128, q_lora_rank=128,
              v_head_dim=32)


@pytest.fixture(scope="module")
def deepseek_fp8_dir(tmp_path_factory) -> tuple[str, str]:
    """(the FP8 checkpoint, its weights dequantized in f32)."""
    from safetensors.torch import load_file, save_file

    d = str(tmp_path_factory.mktemp("deepseek_v3_fp8"))
    save_hf_model("deepseek_v3", d, seed=3, **SHAPES)
    tensors = {}
    for name, x in load_file(os.path.join(d, "model.safetensors")).items():   # per-expert, as on the Hub
        tensors[name] = x.to(torch.bfloat16)
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale_inv = fp8_blocks(tensors[name].float().numpy())
            tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(pathlib.Path(d, "config.json").read_text())
    pathlib.Path(d, "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    float_dir = str(tmp_path_factory.mktemp("deepseek_v3_fp8_dequantized"))
    save_file({name: dequantized(name, x, tensors) for name, x in tensors.items() if not name.endswith("_scale_inv")},
              os.path.join(float_dir, "model.safetensors"), metadata={"format": "pt"})
    pathlib.Path(float_dir, "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return d, float_dir


def dequantized(name: str, x, tensors: dict):
    """A tensor in f32: an e4m3 weight times its 128x128 blocks' scale_inv."""
    if x.dtype != torch.float8_e4m3fn:
        return x.float()
    out, inp = x.shape
    scale = tensors[name + "_scale_inv"].repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    return x.float() * scale


def test_deepseek_v3_fp8_loads_experts_in_fp8_and_matches_transformers(deepseek_fp8_dir):
    """Experts stacked as stored (fp8 [experts, out, in], a scale per output row and 128 inputs:
    each block's repeated over its rows), a quarter of their f32 bytes and a scale per 128; the
    router in f32; kv_b_proj fp8, dequantized whole in the step (models/mla.py); logits within
    1e-4 of transformers' on the dequantized weights."""
    fp8_dir, float_dir = deepseek_fp8_dir
    cfg = ModelConfig.from_pretrained(fp8_dir)
    params = load_params(fp8_dir, cfg)
    moe = params["model"]["layers_1"]["mlp"]
    gate = moe["experts"]["gate_proj"]
    assert gate["qweight"].dtype == ml_dtypes.float8_e4m3fn and gate["qweight"].shape == (8, 128, 128)
    assert gate["scale"].shape == (8, 128, 1) and moe["gate"]["weight"].dtype == np.float32
    elements = sum(x["qweight"].size for x in moe["experts"].values())
    assert weight_bytes(moe["experts"]) == elements + 4 * elements // 128
    assert params["model"]["layers_0"]["self_attn"]["kv_b_proj"]["qweight"].dtype == ml_dtypes.float8_e4m3fn
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 24))
    model = build_model(cfg)
    ours = model.apply({"params": params}, ids, np.arange(24)[None], method=model.forward_logits)
    with torch.no_grad():
        expected = reference(float_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


def test_deepseek_v3_quantized_at_load_runs_its_latent_attention(deepseek_fp8_dir):
    """`--quantization int8` on DeepSeek: kv_b_proj int8 too (used in parts, dequantized whole in
    the step); the logits' mean error under 15% of the unquantized ones' spread (measured 9%: the
    experts alone quantized 0.9%, the attention alone 8.7%, this random tiny model's norms amplify)."""
    float_dir = deepseek_fp8_dir[1]
    cfg = ModelConfig.from_pretrained(float_dir)
    model = build_model(cfg)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 24))
    logits = {}
    for mode in (None, "int8"):
        params = load_params(float_dir, cfg, quantization=mode)
        logits[mode] = np.asarray(model.apply({"params": params}, ids, np.arange(24)[None], method=model.forward_logits))
    assert params["model"]["layers_0"]["self_attn"]["kv_b_proj"]["qweight"].dtype == np.int8
    assert np.abs(logits["int8"] - logits[None]).mean() < 0.15 * logits[None].std()
