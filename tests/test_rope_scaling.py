"""RoPE scaling kinds beyond the parity checkpoints' (tests/hf_models.py): yarn (Qwen2.5 / Qwen3
long context, DeepSeek-style mscale), longrope (Phi-3.5, Phi-4-mini with partial rotary), dynamic
NTK. Frequencies against transformers' own rope functions on config.json files shaped as the
published ones; logits and greedy tokens against transformers models.

longrope and dynamic pick their frequencies by the context length: transformers per forward pass,
jaxserve once per engine by max_model_len (as vLLM). Each comparison below runs where the two
agree: every token of the compared sequences on the same side of the pretraining length."""
import json
import os

import numpy as np
import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.models import build_model
from jaxserve.models.layers import rope_frequencies
from tests.hf_models import save_byte_tokenizer

RNG = np.random.default_rng(0)
# config.json files shaped as published checkpoints' (the longrope factors are random: their
# values do not change the formulas).
PHI35_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
                  intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                  rope_scaling={"type": "longrope", "long_factor": (1 + 40 * RNG.random(48)).tolist(),
                                "short_factor": (1 + RNG.random(48)).tolist()})
PHI4_MINI = dict(PHI35_MINI, vocab_size=200064, num_attention_heads=24, num_key_value_heads=8,
                 partial_rotary_factor=0.75, tie_word_embeddings=True)
QWEN25_YARN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
                   intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                   max_position_embeddings=32768, rope_theta=1000000.0,
                   rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
QWEN3_YARN = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
                  intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
LLAMA_YARN_MSCALE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
                         intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         max_position_embeddings=163840, rope_theta=10000.0,
                         rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                       "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096})
LLAMA2_DYNAMIC = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
                      intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      max_position_embeddings=4096, rope_theta=10000.0,
                      rope_scaling={"type": "dynamic", "factor": 2.0})
PUBLISHED = {"phi3.5-mini": PHI35_MINI, "phi4-mini": PHI4_MINI, "qwen2.5-yarn": QWEN25_YARN,
             "qwen3-yarn": QWEN3_YARN, "llama-yarn-mscale": LLAMA_YARN_MSCALE, "llama2-dynamic": LLAMA2_DYNAMIC}


def _write(config: dict, d: str) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("context", ["short", "long"])
def test_frequencies_match_transformers(name, context, tmp_path):
    """Within the pretraining length (4,096 tokens) and at the model's whole length."""
    d = _write(PUBLISHED[name], str(tmp_path))
    hf_cfg = tf.AutoConfig.from_pretrained(d)
    ours = ModelConfig.from_pretrained(d)
    length = 4096 if context == "short" else ours.max_position_embeddings * (2 if "dynamic" in name else 1)
    kind = ours.rope_scaling.kind
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu", seq_len=length)
    freq, scale = rope_frequencies(ours.serving(length))
    np.testing.assert_allclose(freq, ref_freq.numpy(), rtol=2e-6)
    assert scale == pytest.approx(ref_scale, rel=1e-6)
    if kind == "longrope":   # the two factor sets differ: the length chose one
        assert not np.allclose(freq, rope_frequencies(ours.serving(8192 if context == "short" else 4096))[0])


def test_frequencies_of_unscaled_kinds_ignore_the_context():
    cfg = ModelConfig.from_hf_dict(dict(LLAMA2_DYNAMIC, rope_scaling=None))
    assert np.array_equal(rope_frequencies(cfg.serving(64))[0], rope_frequencies(cfg.serving(10 ** 6))[0])


def test_longrope_with_factors_of_the_wrong_length_is_refused():
    bad = dict(PHI35_MINI, rope_scaling=dict(PHI35_MINI["rope_scaling"], short_factor=[1.0] * 47))
    with pytest.raises(ValueError, match="48 values each"):
        ModelConfig.from_hf_dict(bad)


# Small seeded models of the kinds: pretraining length 32, prompts on either side of it.
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, initializer_range=0.1)
MODELS = {
    "phi3_longrope_partial": (tf.Phi3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, max_position_embeddings=512,
        original_max_position_embeddings=32, partial_rotary_factor=0.5,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                      "long_factor": [1.0, 4.0, 9.0, 30.0]})),
    "qwen3_yarn_mscale": (tf.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                      "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8.0})),
    "llama_dynamic": (tf.LlamaConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        rope_scaling={"rope_type": "dynamic", "factor": 3.0})),
}


def _save(name: str, d: str):
    cls, extra = MODELS[name]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cls(**SMALL, **extra), attn_implementation="eager").eval()
    model.save_pretrained(d)
    return model


@pytest.mark.parametrize("name,length,context", [
    ("phi3_longrope_partial", 24, 32), ("phi3_longrope_partial", 40, 512),
    ("qwen3_yarn_mscale", 40, 128), ("llama_dynamic", 48, 48)])
def test_logits_match_transformers(name, length, context, tmp_path):
    """A forward pass of `length` tokens by an engine serving `context` tokens."""
    hf = _save(name, str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    tokens = np.random.default_rng(1).integers(0, 256, (1, length))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    model = build_model(cfg.serving(context))
    ours = model.apply({"params": load_params(str(tmp_path), cfg)}, tokens, np.arange(length)[None],
                       method=model.forward_logits)
    assert np.abs(np.asarray(ours) - ref).max() < 1e-4
    other = build_model(cfg.serving(512 if context <= 32 else 32))   # the other side of the length
    wrong = other.apply({"params": load_params(str(tmp_path), cfg)}, tokens, np.arange(length)[None],
                        method=model.forward_logits)
    if name != "qwen3_yarn_mscale":   # yarn alone is static
        assert np.abs(np.asarray(wrong) - ref).max() > 1e-2


def test_engine_serves_longrope_by_its_max_model_len(tmp_path):
    """Phi-3 longrope with partial rotary through the engine: max_model_len 32 serves with the
    short factors, 512 with the long; greedy tokens equal transformers' generate where that runs
    every token on the same side (24 tokens in all; a 40-token prompt)."""
    d = str(tmp_path)
    hf = _save("phi3_longrope_partial", d)
    save_byte_tokenizer(d)
    hf.generation_config.eos_token_id = None
    rng = np.random.default_rng(2)
    for max_model_len, prompt, new in ((32, rng.integers(0, 256, 8).tolist(), 16),
                                       (512, rng.integers(0, 256, 40).tolist(), 16)):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        llm = LLM(model=d, max_model_len=max_model_len, max_num_seqs=2, max_num_batched_tokens=32,
                  prefill_chunk_size=16, page_size=8, num_pages=16, compilation_cache_dir=None)
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == expected, max_model_len
