"""Pre-quantized mixture-of-experts checkpoints: a seeded DeepSeek-V3 written in DeepSeek's and
Qwen's block-FP8 format (every expert's, the shared expert's, the dense MLP's and the latent
attention's projections, kv_b_proj among them, e4m3 in 128x128 blocks with their
`weight_scale_inv`; the router unquantized), loaded with its experts kept in fp8, against
transformers on the same weights dequantized as the format defines (fp8 times its block's
scale_inv, in f32). transformers 5.24 reading the FP8 files themselves on CPU gives other logits
(4.5 apart at most, where ours and its own on the dequantized weights are 1e-5 apart). The block
writer is tests/test_prequantized_fp8.py's. And a seeded Qwen3-MoE in AutoAWQ's format (4 bits with
zero points, every expert's projections among them, the routers left unconverted), its experts
kept int4_asym, against transformers on its weights dequantized."""
import json
import os
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams, prequantized, quantization
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.models import build_model, experts
from jaxserve.quantization import weight_bytes
from tests.hf_models import hf_greedy, save_byte_tokenizer, save_hf_model
from tests.test_prequantized import awq, forward_logits, reference
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
    assert_logits_match(cfg, params, float_dir)


def assert_logits_match(cfg, params, float_dir):
    """Our logits of 24 random tokens with `params` within 1e-4 of transformers' with float_dir's model."""
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 24))
    ours = forward_logits(build_model(cfg), params, ids)
    with torch.no_grad():
        expected = reference(float_dir)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), expected, atol=1e-4, rtol=1e-4)


def test_deepseek_v3_quantized_at_load_runs_its_latent_attention(deepseek_fp8_dir):
    """`--quantization int8` on DeepSeek: kv_b_proj int8 too (used in parts, dequantized whole in
    the step); the logits' mean error under 15% of the unquantized ones' spread (measured 9%: the
    experts alone quantized 0.9%, the attention alone 8.7%, this random tiny model's norms amplify).
    `int4_asym` (zero points: kv_b_proj's and every expert's among them) gives the logits of its
    weights dequantized."""
    float_dir = deepseek_fp8_dir[1]
    cfg = ModelConfig.from_pretrained(float_dir)
    model = build_model(cfg)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 24))

    def logits(params):
        return np.asarray(forward_logits(model, params, ids))
    full, int8 = (logits(load_params(float_dir, cfg, quantization=mode)) for mode in (None, "int8"))
    assert np.abs(int8 - full).mean() < 0.15 * full.std()
    asym = load_params(float_dir, cfg, quantization="int4_asym")
    assert "zero" in asym["model"]["layers_0"]["self_attn"]["kv_b_proj"]
    assert "zero" in asym["model"]["layers_1"]["mlp"]["experts"]["down_proj"]
    np.testing.assert_allclose(logits(asym), logits(dequantized_params(asym)), atol=1e-4, rtol=1e-4)


def dequantized_params(tree):
    """A params tree with each quantized Linear's leaves as its `weight` and each quantized stack
    as its weights, in f32 (quantization.dequantize, zero-point offsets included)."""
    if not isinstance(tree, dict):
        return tree
    if "qweight" not in tree:
        return {k: dequantized_params(v) for k, v in tree.items()}
    if tree["qweight"].ndim == 3:
        return experts.dequantized(tree, jnp.float32)
    rest = {k: v for k, v in tree.items() if k not in quantization.LEAVES}
    return {**rest, "weight": quantization.dequantize(tree["qweight"], tree["scale"], zero=tree.get("zero"))}


# every Linear's inputs whole groups of 128 (4 heads of 32), its outputs whole words of 8
QWEN3_MOE_SHAPES = dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256, head_dim=32)


def asym_groups(w: np.ndarray):
    """AutoAWQ's quantization of a weight [out, in]: per 128 inputs, 16 levels from the group's
    minimum to its maximum (0 among them); (codes 0..15, f16 scales, zero points 0..15), each
    [out, ...], weight ~ scale * (code - zero point)."""
    out, inp = w.shape
    groups = w.reshape(out, inp // 128, 128)
    low, high = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    scale = ((high - low) / 15).astype(np.float16)
    zeros = np.round(-low / scale.astype(np.float32))
    codes = np.clip(np.round(groups / scale[..., None].astype(np.float32)) + zeros[..., None], 0, 15)
    return codes.reshape(out, inp).astype(np.int32), scale, zeros.astype(np.int32)


@pytest.fixture(scope="module")
def qwen3_moe_awq(tmp_path_factory) -> tuple[str, str, list[list[int]]]:
    """(the AWQ checkpoint, its weights dequantized in f32, transformers' greedy tokens on those)."""
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    d, float_dir = (str(tmp_path_factory.mktemp(name)) for name in ("qwen3_moe_awq", "qwen3_moe_awq_dequantized"))
    save_hf_model("qwen3_moe", d, seed=2, **QWEN3_MOE_SHAPES)
    save_byte_tokenizer(d)
    tensors, dequantized = {}, {}
    for name, x in load_file(os.path.join(d, "model.safetensors")).items():   # per-expert, as on the Hub
        x = x.float().numpy()
        if name.endswith("proj.weight"):   # attention's, the dense MLP's and every expert's; not the routers
            codes, scale, zeros = awq_args = asym_groups(x)
            base = name.removesuffix("weight")
            tensors.update({base + k: np.ascontiguousarray(v) for k, v in awq(*awq_args).items()})
            x = (scale.astype(np.float32).repeat(128, 1) * (codes - zeros.repeat(128, 1))).astype(np.float32)
        else:
            tensors[name] = x
        dequantized[name] = x
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(float_dir, "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(pathlib.Path(d, "config.json").read_text())
    pathlib.Path(float_dir, "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    pathlib.Path(d, "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["gate"]}}))
    hf = reference(float_dir)
    return d, float_dir, [hf_greedy(hf, p, 12)[0] for p in awq_prompts(hf.config.vocab_size)]


def awq_prompts(vocab: int) -> list[list[int]]:
    return [np.random.RandomState(i).randint(1, vocab, 10 + 3 * i).tolist() for i in range(3)]


def test_qwen3_moe_awq_loads_experts_as_int4_asym_and_matches_transformers(qwen3_moe_awq):
    """Experts stacked as stored (int4 codes, a scale and a zero-point offset per 128 inputs),
    the router in f32; logits within 1e-4 of transformers' on the dequantized weights, and the
    engine's greedy tokens its."""
    awq_dir, float_dir, expected = qwen3_moe_awq
    cfg = ModelConfig.from_pretrained(awq_dir)
    params = load_params(awq_dir, cfg)
    moe = params["model"]["layers_1"]["mlp"]
    down = moe["experts"]["down_proj"]
    assert down["qweight"].dtype == np.uint8 and down["qweight"].shape == (cfg.num_experts, 128, 128)
    assert down["scale"].shape == down["zero"].shape == (cfg.num_experts, 128, 2)
    assert moe["gate"]["weight"].dtype == np.float32
    assert_logits_match(cfg, params, float_dir)
    llm = LLM(model=awq_dir, max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64, max_model_len=128,
              kv_cache_mb=4, compilation_cache_dir=None, step_shapes="largest")
    out = llm.generate([{"prompt_token_ids": p} for p in awq_prompts(cfg.vocab_size)],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected


def test_routers_may_be_left_unconverted_and_nothing_else():
    """AutoAWQ's `modules_to_not_convert` and LLM Compressor's `ignore` may name MoE routers (read
    unquantized anyway) beside lm_head; another module left unquantized is refused."""
    assert all(map(prequantized._router, ["gate", "model.layers.3.mlp.gate", "re:.*mlp.gate$", "shared_expert_gate"]))
    assert not any(map(prequantized._router, ["gate_proj", "re:.*mlp.gate_proj$", "model.layers.0.mlp.experts.0.up_proj"]))
    awq_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    for config in ({**awq_config, "modules_to_not_convert": ["model.layers.0.mlp.down_proj"]},):
        with pytest.raises(ValueError, match="left unquantized besides lm_head and the routers"):
            prequantized._awq(config)
    assert prequantized._awq({**awq_config, "modules_to_not_convert": ["gate", "lm_head"]}).mode == "int4_asym"
