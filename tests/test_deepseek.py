"""DeepSeek-V2 and V3 beyond the mixtures of experts' parity checks (tests/test_moe.py runs the
seeded deepseek_v3 and deepseek_v2_lite checkpoints through f32 logits on both expert paths, the
save round trip and the engine with a prefix hit; tests/test_expert_parallel.py the engine under
tensor parallelism, V2-Lite's at TP 2, and under expert and sequence parallelism, V3's, and V3's
latent attention at TP 4 against one device): the engine's KV pool holds the latent, one KV head
of kv_lora_rank + qk_rope_head_dim dims, through the Pallas TPU kernels; the Hub's config.json
files read to transformers' softmax scale and RoPE; a V3-architecture step compiled for a TPU."""
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from jaxserve import LLM, SamplingParams, check
from jaxserve.buckets import Buckets
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.kv_cache import page_bytes_per_chip
from jaxserve.models.layers import rope_frequencies
from jaxserve.models.mla import LatentDims
from jaxserve.models.routing import Routing
from tests.engine_runs import ENGINE, _prompts
from tests.test_family_engine import save_with_greedy
from tests.test_tpu_compile import ROOT, assert_serves, with_ci_layers

YARN_V3 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
           "original_max_position_embeddings": 4096}
# config.json of DeepSeek-V3 (R1's is the same) and DeepSeek-V2-Lite as on the Hub
# (the keys transformers reads).
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=129280,
                   hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                   num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                   v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
                   num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True,
                   scoring_func="sigmoid", rms_norm_eps=1e-6, rope_theta=10000, rope_scaling=YARN_V3,
                   max_position_embeddings=163840, torch_dtype="bfloat16", bos_token_id=0, eos_token_id=1)
DEEPSEEK_V2_LITE = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=102400,
                        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                        num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
                        routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                        v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
                        num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False,
                        scoring_func="softmax", rms_norm_eps=1e-6, rope_theta=10000,
                        rope_scaling={**YARN_V3, "mscale": 0.707, "mscale_all_dim": 0.707},
                        max_position_embeddings=163840, torch_dtype="bfloat16", bos_token_id=100000,
                        eos_token_id=100001)
# model_type -> transformers' config, attention and rotary classes
HF_CLASSES = {"deepseek_v2": (tf.DeepseekV2Config, v2.DeepseekV2Attention, v2.DeepseekV2RotaryEmbedding),
              "deepseek_v3": (tf.DeepseekV3Config, v3.DeepseekV3Attention, v3.DeepseekV3RotaryEmbedding)}
# Moonlight-16B-A3B's (V3's architecture), as configs/moonlight-16b-a3b-v6e-4.yaml serves it.
with open(os.path.join(ROOT, "configs", "models", "moonlight-16b-a3b", "config.json")) as f:
    MOONLIGHT = json.load(f)
# The interpreted Pallas kernels take about a second a step: the engine's first 4 greedy tokens,
# not tests/test_family_engine.engine_tokens' 24; prefill chunks and decodes run all the same.
PALLAS_TOKENS = 4


def test_v3_config_as_published_and_its_latent_kv_bytes():
    """DeepSeek-V3: MoE from layer 3, 8 groups of 32 experts (4 kept), sigmoid scores with the
    selection bias, one shared expert; its KV cache per token and layer, one 576-dim head held
    once, as K (the values are the keys: 1.125 KiB in bf16), is 1/71.1 of per-head K/V (128 heads
    of 192 + 128 dims)."""
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert cfg.mla == LatentDims(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                 q_lora_rank=1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (128, 1, 576)
    assert cfg.moe_layers == tuple(range(3, 61)) and cfg.moe_shared_intermediate_size == 2048
    assert cfg.moe_routing == Routing(sigmoid=True, selection_bias=True, groups=8, topk_groups=4, group_top=2,
                                      scale=2.5)
    assert cfg.norm_topk_prob and cfg.rope_interleaved
    latent = page_bytes_per_chip(cfg, jnp.bfloat16, page_size=1, model_axis=1, tpu=False) // cfg.num_layers
    per_head = 2 * cfg.num_heads * (128 + 64 + 128)   # bf16 K (nope + rope) and V, every head
    assert cfg.values_are_keys
    assert latent == 576 * 2 == 1152 and per_head == 81920


@pytest.mark.parametrize("hf_config", [DEEPSEEK_V3, DEEPSEEK_V2_LITE, MOONLIGHT], ids=["v3", "v2_lite", "moonlight"])
def test_softmax_scale_and_rope_as_transformers(hf_config):
    """The softmax scale (YaRN's mscale_all_dim squared over sqrt(192)) and the RoPE frequencies
    and cos/sin scale of the Hub's configs, as transformers' attention and rotary modules have them."""
    config_class, attention_class, rotary_class = HF_CLASSES[hf_config["model_type"]]
    hf_cfg = config_class(**hf_config)
    with torch.device("meta"):   # the scale only: no weights
        attn = attention_class(hf_cfg, 0)
    rotary = rotary_class(hf_cfg)
    cfg = ModelConfig.from_hf_dict(hf_config)
    assert cfg.attn_scale == pytest.approx(attn.scaling, rel=1e-12)
    inv_freq, scale = rope_frequencies(dataclasses.replace(cfg, head_dim=cfg.mla.qk_rope_head_dim))
    assert np.allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert scale == pytest.approx(rotary.attention_scaling)


def test_engine_kv_pool_holds_the_latent_once(tmp_path):
    """Every layer's pool: one KV head of kv_lora_rank 32 + qk_rope_head_dim 8, as K alone (no V
    pool: the values are the keys). Through the Pallas TPU kernels (interpret mode: flash for
    fresh prefill rows, the paged kernel for the rest, both reading V from K) the greedy tokens
    are transformers' (the XLA path's: tests/test_moe.py), the first prompt alone and then the
    others, one of them on its prefix in the cache (as engine_tokens runs them)."""
    d = str(tmp_path)
    want = save_with_greedy("deepseek_v3", d)
    llm = LLM(model=d, **ENGINE, attention_backend="pallas_tpu")
    layers = llm.llm_engine.runner.kv_cache.layers
    assert len(layers) == 3
    assert {layer.k.shape for layer in layers} == {(ENGINE["num_pages"], 1, 8, 40)}
    assert all(layer.v is None and layer.v_scale is None for layer in layers)
    prompts, sp = _prompts(256), SamplingParams(temperature=0.0, max_tokens=PALLAS_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts[:1], sp, use_tqdm=False) + llm.generate(prompts[1:], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [tokens[:PALLAS_TOKENS] for tokens in want]
    assert llm.llm_engine.block_manager.prefix_hit_rate > 0


def test_moonlight_decode_step_compiles_for_tpu():
    """Moonlight-16B-A3B (V3's architecture) bf16 at TP 4 on v6e-4, cut to 2 layers (a dense one,
    an MoE one) with the KV pool sized for all 27: the Pallas TPU paged kernel over the one
    replicated latent KV head (576 dims in 640 lanes), each chip its 4 query heads (Mosaic refuses
    a call XLA would partition: attention's shard_map), compiles and fits without whole-pool
    copies. One shape (suite time): the prefill step compiles too (16 s)."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), mesh={"model": 4})
    tpu = check.tpu_slice("v6e-4")
    cfg = with_ci_layers(ModelConfig.from_hf_dict(MOONLIGHT), ecfg, tpu, 4, "moonlight")
    shapes = [s for s in check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False)) if s.name == "decode-8"]
    report = check.check(ecfg, cfg, tpu, model_name="moonlight", dtype=jnp.bfloat16, shapes=shapes, samplers=False)
    assert_serves(report, "moonlight (2 layers) on v6e-4")
