"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss, GLM-4.5, DeepSeek-V2 and
V3: their latent attention and routing, tests/test_deepseek.py) against transformers on seeded
checkpoints written by its save_pretrained (per-expert tensors as on the Hub; gpt-oss's fused):
full-sequence logits, the engine's greedy tokens on one device, the checkpoint written back, the
FLOP estimate, what is refused, the collectives of an MoE layer under tensor parallelism, and an
engine step of Qwen3-30B-A3B's shapes compiled for a TPU through libtpu. The engine under tensor
and expert parallelism (fake CPU devices): tests/test_expert_parallel.py."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve import check, lora, parallel, roofline
from jaxserve.buckets import Buckets
from jaxserve.checkpoint import load_params, param_shapes, save_pretrained
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import build_model, layers
from jaxserve.models.routing import Routing
from tests.hf_models import MOE_CONFIGS
from tests.engine_runs import engine_tokens
from tests.test_family_engine import save_with_greedy
from tests.test_tpu_compile import CI_LAYERS, ROOT, assert_serves, with_ci_layers

# Qwen3-30B-A3B's config.json as on the Hub (the keys the parser reads).
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                     hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)

# gpt-oss-20b's config.json as on the Hub (rope_scaling beside rope_theta, as written by transformers 4.55).
GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, eos_token_id=200002,
                   experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
                   intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
                   max_position_embeddings=131072, num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=24,
                   num_key_value_heads=8, num_local_experts=32, pad_token_id=199999, rms_norm_eps=1e-05,
                   quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                       "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
                   rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "rope_type": "yarn", "truncate": False},
                   rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088,
                   torch_dtype="bfloat16")

# GLM-4.5-Air's and Qwen1.5-MoE-A2.7B's config.json as on the Hub (the keys the parsers read;
# transformers' Glm4MoeConfig and Qwen2MoeConfig defaults are these models' shapes).
GLM_4_5_AIR = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", attention_bias=True, head_dim=128,
                   hidden_act="silu", hidden_size=4096, intermediate_size=10944, partial_rotary_factor=0.5,
                   max_position_embeddings=131072, moe_intermediate_size=1408, norm_topk_prob=True,
                   num_attention_heads=96, n_group=1, topk_group=1, n_routed_experts=128, n_shared_experts=1,
                   routed_scaling_factor=1.0, num_experts_per_tok=8, first_k_dense_replace=1, num_hidden_layers=46,
                   num_key_value_heads=8, num_nextn_predict_layers=1, rms_norm_eps=1e-5, rope_scaling=None,
                   rope_theta=1000000, tie_word_embeddings=False, use_qk_norm=False, vocab_size=151552,
                   torch_dtype="bfloat16", pad_token_id=151329, eos_token_id=[151329, 151336, 151338])
QWEN1_5_MOE_A2_7B = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", bos_token_id=151643,
                         eos_token_id=151643, hidden_act="silu", hidden_size=2048, intermediate_size=5632,
                         max_position_embeddings=8192, max_window_layers=21, num_attention_heads=16,
                         num_hidden_layers=24, num_key_value_heads=16, rms_norm_eps=1e-6, rope_theta=1000000.0,
                         sliding_window=32768, use_sliding_window=False, tie_word_embeddings=False,
                         vocab_size=151936, decoder_sparse_step=1, moe_intermediate_size=1408,
                         shared_expert_intermediate_size=5632, num_experts_per_tok=4, num_experts=60,
                         norm_topk_prob=False, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (model dir, transformers' greedy tokens for test_family_engine's prompts)."""
    out = {}
    for name in sorted(MOE_CONFIGS):
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, save_with_greedy(name, d))
    return out


def hf_logits(model_dir: str, tokens: np.ndarray) -> np.ndarray:
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(torch.tensor(tokens)).logits.numpy()


@pytest.fixture(scope="module")
def reference(checkpoints) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Two 40-token rows and transformers' logits of them, per checkpoint (once for both expert paths)."""
    tokens = np.random.RandomState(2).randint(0, 256, (2, 40))   # every MOE_CONFIGS vocabulary: 256
    return tokens, {name: hf_logits(d, tokens) for name, (d, _) in checkpoints.items()}


@pytest.mark.parametrize("path", ["every_expert", "grouped_experts"])
@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_logits_match_transformers(name, path, checkpoints, reference, monkeypatch):
    """f32 logits of two 40-token rows within 1e-4 of transformers', through CPU's path (every
    expert) and the accelerators' (grouped ragged_dot, put in CPU's place: XLA:CPU runs it too)."""
    monkeypatch.setattr(layers, "every_expert", getattr(layers, path))
    model_dir = checkpoints[name][0]
    cfg = ModelConfig.from_pretrained(model_dir)
    params = load_params(model_dir, cfg)
    tokens, ref = reference[0], reference[1][name]
    model = build_model(cfg)
    ours = np.asarray(model.apply({"params": params}, tokens, np.broadcast_to(np.arange(40), tokens.shape),
                                  method=model.forward_logits))
    assert np.abs(ours - ref).max() < 1e-4, name
    assert np.abs(ref).max() > 0.1


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_the_saved_checkpoint_loads_back(name, checkpoints, reference, tmp_path):
    """save_pretrained of the loaded params writes the per-expert tensors transformers reads back to
    the same logits (the params, and so what is written, do not depend on the expert path)."""
    model_dir = checkpoints[name][0]
    params = load_params(model_dir, ModelConfig.from_pretrained(model_dir))
    with open(os.path.join(model_dir, "config.json")) as f:
        save_pretrained(params, json.load(f), str(tmp_path))
    assert np.abs(hf_logits(str(tmp_path), reference[0]) - reference[1][name]).max() < 1e-6


def test_config_reads_moe_layers():
    c = ModelConfig.from_hf_dict({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                                  "mlp_only_layers": [3]})
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.moe_layers == (1, 5) and c.qk_norm   # every 2nd layer, not 3


def test_gpt_oss_20b_config_reads_as_transformers_reads_it(tmp_path):
    """gpt-oss-20b's config.json: windows, experts, the YaRN frequencies (untruncated) and their
    attention factor, and the parameter count of transformers' model (built on the meta device)
    cut to two layers (suite time), one of each type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    hf = tf.AutoConfig.from_pretrained(str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.sliding_windows == tuple(128 if t == "sliding_attention" else None for t in hf.layer_types)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers) == (32, 4, 2880,
                                                                                                    tuple(range(24)))
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.swiglu_alpha, cfg.swiglu_limit) == (64, 8, 1.702, 7.0)
    assert cfg.qkv_bias and cfg.o_bias and cfg.attn_sinks and cfg.moe_bias and cfg.moe_softmax_topk
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours, scale = layers.rope_frequencies(cfg)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(factor, rel=1e-12) and not cfg.rope_scaling.truncate
    two = {**GPT_OSS_20B, "num_hidden_layers": 2, "layer_types": GPT_OSS_20B["layer_types"][:2]}
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(type(hf).from_dict(two))
    assert ModelConfig.from_hf_dict(two).num_params == sum(p.numel() for p in model.parameters())



def test_glm_4_5_air_and_qwen1_5_moe_configs_read_as_transformers_reads_them(tmp_path):
    """GLM-4.5-Air: RoPE on half of each 128-dim head as transformers' rotary module has it, MoE from
    layer 1 with V3's routing in one group and a shared expert; Qwen1.5-MoE-A2.7B: experts on every
    layer beside a gated shared expert, windows (when on) where transformers' layer_types put them;
    the parameter counts of transformers' models (the meta device) cut to two layers (suite time):
    GLM's dense and MoE layer (the selection bias is a buffer there), Qwen's shared expert and gate."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    glm = ModelConfig.from_hf_dict(GLM_4_5_AIR)
    assert (glm.head_dim, glm.num_kv_heads, glm.rope_scaling.rotary_fraction, glm.rope_theta) == (128, 8, 0.5, 1e6)
    assert not glm.rope_interleaved
    assert glm.qkv_bias and not glm.o_bias and not glm.qk_norm and glm.norm_topk_prob
    assert (glm.num_experts, glm.num_experts_per_tok, glm.moe_intermediate_size, glm.moe_shared_intermediate_size,
            glm.moe_layers) == (128, 8, 1408, 1408, tuple(range(1, 46)))
    assert glm.moe_routing == Routing(sigmoid=True, selection_bias=True, group_top=2)
    inv_freq = layers.rope_frequencies(glm)[0]
    np.testing.assert_allclose(inv_freq, Glm4MoeRotaryEmbedding(tf.Glm4MoeConfig(**GLM_4_5_AIR)).inv_freq.numpy(),
                               rtol=1e-6)
    qwen = ModelConfig.from_hf_dict(QWEN1_5_MOE_A2_7B)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.moe_shared_intermediate_size,
            qwen.moe_layers) == (60, 4, 1408, 5632, tuple(range(24)))
    assert qwen.moe_shared_gate and qwen.qkv_bias and not qwen.o_bias and not qwen.norm_topk_prob
    windowed = {**QWEN1_5_MOE_A2_7B, "use_sliding_window": True}
    assert ModelConfig.from_hf_dict(windowed).sliding_windows == tuple(
        32768 if t == "sliding_attention" else None for t in tf.Qwen2MoeConfig(**windowed).layer_types)
    for published in (GLM_4_5_AIR, QWEN1_5_MOE_A2_7B):
        two = {**published, "num_hidden_layers": 2}
        (tmp_path / "config.json").write_text(json.dumps(two))
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(str(tmp_path)))
        assert ModelConfig.from_hf_dict(two).num_params == sum(t.numel() for t in model.state_dict().values())


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_engine_greedy_matches_transformers(name, checkpoints):
    model_dir, expected = checkpoints[name]
    tokens, hit_rate = engine_tokens(model_dir)
    assert tokens == expected, name
    assert hit_rate > 0


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_flops_count_active_experts_and_bytes_all(name, checkpoints):
    """The roofline's per-token FLOPs from the parameters a token meets in transformers' model
    (each MoE layer's experts, gpt-oss's biases too, by the share it is routed to); weight bytes:
    every parameter."""
    model_dir = checkpoints[name][0]
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = ModelConfig.from_pretrained(model_dir)
    share = cfg.num_experts_per_tok / cfg.num_experts
    met = sum(p.numel() * (share if ".experts." in n else 1) for n, p in hf.named_parameters()
              if "embed_tokens" not in n and "lm_head" not in n)
    cost = roofline.CostModel(cfg, 4)
    assert cost.token_params == met
    assert cost.weight_bytes == 4 * sum(p.numel() for n, p in hf.named_parameters() if "embed_tokens" not in n)


def test_quantization_and_lora_are_refused(checkpoints):
    model_dir = checkpoints["mixtral"][0]
    cfg = ModelConfig.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="mixture-of-experts model: its experts cannot be quantized as w8a8"):
        param_shapes(cfg, quantization="w8a8")
    with pytest.raises(ValueError, match="LoRA is not supported on mixture-of-experts models"):
        lora.linear_modules(cfg)


def test_qwen3_30b_a3b_steps_compile_for_tpu():
    """Qwen3-30B-A3B bf16 at TP 4 on v6e-4 (its 61 GB of weights need 4 chips), cut to CI_LAYERS
    layers with the KV pool sized for all 48: the smallest decode step (ragged_dot through
    XLA:TPU's grouped-matmul kernels, each expert's intermediate dim split 4 ways) compiles and
    fits, no whole-pool copies. One shape (suite time): the prefill step compiles too (15 s)."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), mesh={"model": 4})
    tpu = check.tpu_slice("v6e-4")
    cfg = with_ci_layers(ModelConfig.from_hf_dict(QWEN3_30B_A3B), ecfg, tpu, 4, "qwen3-30b-a3b")
    shapes = check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False))[1:2]
    report = check.check(ecfg, cfg, tpu, model_name="qwen3-30b-a3b", dtype=jnp.bfloat16, shapes=shapes,
                         samplers=False)
    assert_serves(report, f"qwen3-30b-a3b ({CI_LAYERS} layers) on v6e-4")


def test_tensor_parallel_moe_all_reduces_tokens_not_their_k_rows():
    """Under TP each device's share of every expert gives partial sums: the one all-reduce of an
    MoE layer compiled for v6e-4 moves [tokens, hidden], not the grouped product's [tokens * k,
    hidden] rows (what XLA chose when it partitioned the layer itself)."""
    tokens, hidden, top_k = 64, 256, 4
    mesh = parallel.make_mesh({"model": 4}, check.tpu_slice("v6e-4").devices)
    moe = layers.SparseMoE(16, top_k, 128, True, dtype=jnp.bfloat16, mesh=mesh)
    shapes = jax.eval_shape(moe.init, jax.random.key(0), jnp.zeros((tokens, hidden), jnp.bfloat16))
    cfg = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                          {"params": parallel.param_shardings(shapes["params"], mesh, cfg)})
    x = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16, sharding=parallel.replicated(mesh))
    hlo = jax.jit(moe.apply).lower(params, x).compile().as_text()
    assert "ragged-dot" in hlo   # XLA:TPU's grouped kernels
    assert re.findall(r"= (\w+\[[\d,]*\])\S* all-reduce\(", hlo) == [f"bf16[{tokens},{hidden}]"]


def test_moe_layer_compiles_for_h100():
    """An MoE layer compiles for an H100 through XLA:GPU (compile-only) by every_expert, not by
    ragged_dot, which XLA:GPU turns into dense products masked by expert (layers.every_expert)."""
    device = jax.sharding.SingleDeviceSharding(check.gpu_slice("h100").devices[0])
    moe = layers.SparseMoE(16, 4, 128, True, dtype=jnp.bfloat16)
    shapes = jax.eval_shape(moe.init, jax.random.key(0), jnp.zeros((64, 256), jnp.bfloat16))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=device)
    hlo = jax.jit(moe.apply).lower(params, x).compile().as_text()
    assert "every_expert" in hlo and "ragged" not in hlo
