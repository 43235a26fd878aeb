"""Pre-quantized FP8 checkpoints: a Qwen-FP8-style block-wise checkpoint written with numpy and
ml_dtypes, read by transformers (which dequantizes it on CPU) as the reference, and
compressed-tensors' float-quantized ones (its FP8-dynamic, static and block schemes, and the static
one described as AutoFP8) against their weights dequantized by compressed-tensors. The writers and
comparisons are tests/test_prequantized.py's."""
import functools
import json
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from tests.hf_models import save_engine_model
from tests.test_prequantized import (assert_logits_match, assert_refused, dequantized_copy, engine_greedy, hf_greedy,
                                     save_compressed, variant)


def fp8_args(strategy, **kw):
    from compressed_tensors.quantization import QuantizationArgs
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, **kw)


# compressed-tensors' FP8 schemes: (weights' strategy, input activations)
FP8_COMPRESSED = {"fp8_dynamic": ("channel", dict(strategy="token", dynamic=True)),   # RedHatAI's *-FP8-dynamic
                  "fp8_static": ("tensor", dict(strategy="tensor", dynamic=False)),   # input_scale per tensor
                  "fp8_block": ("block", None)}


@pytest.fixture(scope="module")
def fp8_compressed(tmp_path_factory):
    """name -> (a float-quantized checkpoint of the FP8_COMPRESSED scheme, its weights
    dequantized by compressed-tensors), made on first use."""
    @functools.cache
    def make(name):
        strategy, activations = FP8_COMPRESSED[name]
        weights = fp8_args(strategy, **({"block_structure": [128, 128]} if strategy == "block" else {}))
        d = save_compressed(str(tmp_path_factory.mktemp(name)), weights, "float-quantized",
                            activations and fp8_args(**activations), hidden_size=128, intermediate_size=256)
        return d, dequantized_copy(d, str(tmp_path_factory.mktemp(name + "_float")), weights)
    return make


def fp8_blocks(w):
    """w [out, in] as e4m3 in 128x128 blocks, each over its largest magnitude / 448, and the
    blocks' scale_inv [ceil(out / 128), in / 128] (DeepSeek's and Qwen's FP8 layout)."""
    out, inp = w.shape
    blocks = np.pad(w, ((0, -out % 128), (0, 0))).reshape(-1, 128, inp // 128, 128)
    scale_inv = np.abs(blocks).max(axis=(1, 3)) / 448
    q = (blocks / scale_inv[:, None, :, None]).reshape(-1, inp)[:out].astype(ml_dtypes.float8_e4m3fn)
    return q, scale_inv.astype(np.float32)


@pytest.fixture(scope="module")
def qwen_fp8_dir(tmp_path_factory):
    """A checkpoint as Qwen's *-FP8 (quant_method fp8, e4m3 in 128x128 blocks, dynamic activations):
    every Linear but lm_head as fp8_blocks writes it (scale_inv stored in bf16), everything else
    in bf16. transformers reads it on CPU (FineGrainedFP8 without a GPU: each weight dequantized,
    fp8 times its block's scale_inv, here in float32), so it is its own reference."""
    from safetensors.torch import save_file

    d = str(tmp_path_factory.mktemp("qwen_fp8"))
    tensors = {}
    for name, x in save_engine_model(d, seed=3, hidden_size=128, intermediate_size=256).state_dict().items():
        tensors[name] = x.to(torch.bfloat16)
        if name.endswith("proj.weight"):
            q, scale_inv = fp8_blocks(tensors[name].float().numpy())
            tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale_inv).to(torch.bfloat16)   # as Qwen3.5's
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(pathlib.Path(d, "config.json").read_text())
    pathlib.Path(d, "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))
    return d


@pytest.mark.parametrize("scheme", ["qwen_fp8", *FP8_COMPRESSED, "autofp8"])
def test_fp8_loads_as_stored_and_logits_match_transformers(scheme, request, fp8_compressed, caplog, tmp_path):
    """Each FP8 format; autofp8: fp8_static's tensors (a weight_scale and an input_scale per
    tensor) as AutoFP8 (quant_method fp8 without weight_block_size) describes them."""
    if scheme == "qwen_fp8":
        d = reference_dir = request.getfixturevalue("qwen_fp8_dir")
    elif scheme == "autofp8":
        static_dir, reference_dir = fp8_compressed("fp8_static")
        d = variant(static_dir, tmp_path / scheme, quant_method="fp8", activation_scheme="static")
    else:
        d, reference_dir = fp8_compressed(scheme)
    cfg = ModelConfig.from_pretrained(d)
    params = load_params(d, cfg)
    proj = params["model"]["layers_0"]["mlp"]["down_proj"]
    assert proj["qweight"].dtype == ml_dtypes.float8_e4m3fn and proj["scale"].shape == (cfg.hidden_size, 2)
    assert "weight" in params["lm_head"]
    # activations quantized in the checkpoint: said, and served weight-only
    assert ("served weight-only" in caplog.text) == (scheme != "fp8_block"), caplog.text
    assert_logits_match(cfg, params, reference_dir)

def test_engine_serves_qwen_fp8_as_transformers(qwen_fp8_dir):
    assert engine_greedy(qwen_fp8_dir) == hf_greedy(qwen_fp8_dir)


def test_fp8_variants_not_read_are_refused(qwen_fp8_dir, tmp_path):
    def v(name, tensors=None, **qc):
        return variant(qwen_fp8_dir, tmp_path / name, tensors, **qc)

    e5m2 = torch.zeros(256, 128, dtype=torch.float8_e5m2)
    float_group = {"format": "float-quantized", "targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128}}
    cases = [(v("e5m2", fmt="e5m2"), "fp8 fmt='e5m2'"),
             (v("block_64", weight_block_size=[64, 64]), r"weight_block_size=\[64, 64\]"),
             # a Linear left in bf16 (as Qwen's modules_to_not_convert may say of norms and embeddings)
             (v("unconverted", {"model.layers.0.mlp.down_proj.weight": torch.zeros(128, 256, dtype=torch.bfloat16)},
                modules_to_not_convert=["lm_head", "model.norm", "model.layers.0.mlp.down_proj"]),
              "down_proj.weight is bfloat16, not float8_e4m3fn"),
             (v("stored_e5m2", {"model.layers.0.mlp.up_proj.weight": e5m2}), "up_proj.weight is float8_e5m2"),
             # a head in fp8 where transformers leaves it unquantized: its scale would be lost
             (v("fp8_head", {"lm_head.weight": torch.zeros(258, 128, dtype=torch.float8_e4m3fn)}),
              "a float8 tensor of shape \\[258, 128\\] in the checkpoint where float32 is read"),
             (v("ct_float_group", quant_method="compressed-tensors", config_groups={"group_0": float_group},
                ignore=["lm_head"]), "format 'float-quantized' with weights")]
    assert_refused(cases)
