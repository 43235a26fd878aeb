"""Parity with Hugging Face transformers (PyTorch, float32) on seeded random checkpoints."""
import jax
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.generate import greedy_generate
from jaxserve.models import build_model
from tests.hf_models import BASE, CONFIGS, save_byte_tokenizer, save_hf_model

PROMPT_LENS = (5, 23, 40)
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(request.param, d)
    cfg = ModelConfig.from_pretrained(d)
    return request.param, hf, cfg, load_params(d, cfg)


def _prompts(vocab):
    rng = np.random.RandomState(1)
    return [rng.randint(0, vocab, n).tolist() for n in PROMPT_LENS]


def test_full_sequence_logits_match(pair):
    name, hf, cfg, params = pair
    tokens = np.stack([np.random.RandomState(2).randint(0, cfg.vocab_size, 40)] * 2)
    tokens[1] = tokens[1][::-1]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    model = build_model(cfg)
    pos = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    ours = np.asarray(model.apply({"params": params}, tokens, pos, method=model.forward_logits))
    assert np.abs(ours - ref).max() < 1e-4, name
    assert np.abs(ref).max() > 0.1  # logits are not trivially small


def test_greedy_tokens_and_step_logits_match(pair):
    name, hf, cfg, params = pair
    prompts = _prompts(cfg.vocab_size)
    ours, our_logits = greedy_generate(cfg, params, prompts, NEW_TOKENS, return_logits=True)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0)
        ref_tokens = out.sequences[0, len(p):].tolist()
        assert ours[i] == ref_tokens, (name, i)
        ref_logits = torch.stack(out.logits, 0)[:, 0].numpy()
        assert np.abs(our_logits[i] - ref_logits).max() < 1e-4, (name, i)
    assert len({tuple(o) for o in ours}) == len(prompts)  # prompts lead to different continuations


def test_config_reads_family_features(pair):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    name, _, cfg, _ = pair
    expected = {
        "llama_gqa_rope3": lambda c: c.num_heads == 4 * c.num_kv_heads and c.rope_scaling.kind == "llama3",
        "mistral_window": lambda c: c.sliding_windows == (12, 12),
        "qwen2_bias_tied": lambda c: c.qkv_bias and not c.o_bias and c.tie_word_embeddings,
        "qwen3_qk_norm": lambda c: c.qk_norm and c.head_dim == 32 and not c.qkv_bias,
        "phi3_fused": lambda c: c.num_kv_heads == 2 and c.sliding_windows == (None, None)
        and c.rope_scaling.rotary_fraction == 0.5,
        "gemma_geglu": lambda c: c.hidden_act == "gelu_pytorch_tanh" and c.norm_offset == 1.0 and c.embedding_multiplier == 8.0
        and not c.sandwich_norms and c.attn_scale is None and c.sliding_windows == (None, None) and c.head_dim == 32,
        "gemma2_softcap": lambda c: c.sliding_windows == (12, None) and c.attn_soft_cap == 2.0
        and c.final_soft_cap == 3.0 and c.attn_scale == 24 ** -0.5 and c.tie_word_embeddings,
        "gemma3_local_global": lambda c: c.sliding_windows == (12, 12, None) and c.qk_norm
        and c.local_rope_theta == 100.0 and c.rope_scaling.kind == "linear" and c.attn_soft_cap is None,
        "gemma3_multimodal": lambda c: c.architecture == "Gemma3ForConditionalGeneration" and c.qk_norm
        and c.sliding_windows == (12, None) and c.rope_scaling.factor == 8.0 and c.local_rope_theta == 10000.0,
        "bloom_alibi6": lambda c: c.embed_norm and c.qkv_interleaved and c.norm_bias and c.alibi_slopes
        == tuple(_get_alibi_slopes(6, "cpu").tolist()),
        "mpt_alibi6_clip": lambda c: c.clip_qkv == 0.3 and not c.norm_bias and not c.qkv_bias and c.alibi_slopes
        == tuple((-build_mpt_alibi_tensor(6, 2)[:, 0, 0]).tolist()),
        "granite_multipliers": lambda c: (c.embedding_multiplier, c.residual_multiplier, c.attn_scale, c.logits_scaling)
        == (6.0, 0.3, 0.09, 4.0),
        "gpt_neox_parallel": lambda c: c.parallel_residual and not c.shared_block_norm and c.qkv_interleaved
        and c.rope_scaling.rotary_fraction == 0.5 and c.hidden_act == "gelu" and not c.tie_word_embeddings,
        "phi_partial": lambda c: c.parallel_residual and c.shared_block_norm and c.lm_head_bias
        and c.rope_scaling.rotary_fraction == 0.4 and c.hidden_act == "gelu_new",
        "gpt_bigcode_mqa": lambda c: c.learned_positions and c.num_kv_heads == 1 and not c.qkv_interleaved
        and c.max_position_embeddings == 128 and c.tie_word_embeddings,
        "gpt2_conv1d": lambda c: c.learned_positions and c.num_kv_heads == c.num_heads == 4 and not c.qkv_interleaved
        and c.max_position_embeddings == 512 and c.hidden_act == "gelu_new",
        "gptj_interleaved": lambda c: c.rope_interleaved and c.rope_scaling.rotary_fraction == 0.5 and c.shared_block_norm
        and c.lm_head_bias and not c.qkv_bias and not c.o_bias and c.mlp_bias,
        "glm_interleaved": lambda c: c.rope_interleaved and c.rope_scaling.rotary_fraction == 0.5 and c.qkv_bias
        and not c.o_bias and not c.sandwich_norms,
        "glm4_sandwich": lambda c: c.rope_interleaved and c.sandwich_norms and c.pre_norms and c.qkv_bias,
        "stablelm_qk_layernorm": lambda c: c.gated_mlp and c.shared_block_norm and c.qkv_bias and c.norm_bias
        and c.rope_scaling.rotary_fraction == 0.25 and c.qk_layernorm and not c.qk_norm,
        "cohere_qk_norm": lambda c: c.gated_mlp and c.shared_block_norm and c.rope_interleaved and not c.norm_bias
        and c.logits_scaling == 4.0 and c.tie_word_embeddings and c.qk_layernorm and not c.qk_norm,
        "cohere2_window_nope": lambda c: c.sliding_windows == (12, 12, None) and c.nope_layers == (2,)
        and c.logits_scaling == 4.0 and not c.qk_layernorm,
        "starcoder2_window": lambda c: c.sliding_windows == (12, 12) and c.num_kv_heads == 2 and c.norm_bias
        and c.mlp_bias and not c.parallel_residual and c.tie_word_embeddings,
        "olmo2": lambda c: c.qk_norm and not c.qk_norm_per_head and c.sandwich_norms and not c.pre_norms,
        "olmo3_window": lambda c: c.qk_norm and not c.qk_norm_per_head and not c.pre_norms
        and c.sliding_windows == (12, None) and c.rope_scaling.factor == 4.0 and c.local_rope_theta == 10000.0,
        "ministral_layer_types": lambda c: c.sliding_windows == (None, 12) and not c.qkv_bias and not c.o_bias,
        "smollm3_nope": lambda c: c.nope_layers == (1,) and c.sliding_windows == (None, 12) and c.qkv_bias
        and c.o_bias and c.tie_word_embeddings,
        "seed_oss_bias": lambda c: c.qkv_bias and not c.o_bias and c.head_dim == 32 and not c.nope_layers,
        "helium_interleaved": lambda c: c.rope_interleaved and not c.o_bias and c.rms_norm_eps == 1e-8,
        "ernie4_5_bias": lambda c: c.rope_interleaved and c.qkv_bias and c.o_bias and c.mlp_bias and c.tie_word_embeddings,
        "exaone4_nope": lambda c: c.qk_norm and c.qk_norm_per_head and c.sandwich_norms and not c.pre_norms
        and c.nope_layers == (1,) and c.sliding_windows == (12, None) and not c.qkv_bias,
        "llama_mha": lambda c: c.num_heads == c.num_kv_heads,
        "llama_mqa": lambda c: c.num_kv_heads == 1 and c.qkv_bias and c.o_bias,
    }
    assert expected[name](cfg)


def test_bfloat16_model_tracks_float32(tmp_path):
    import jax.numpy as jnp

    hf = save_hf_model("llama_gqa_rope3", str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    params = load_params(str(tmp_path), cfg, dtype=jnp.bfloat16)
    tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()[0]
    model = build_model(cfg, jnp.bfloat16)
    ours = np.asarray(model.apply({"params": params}, tokens, np.arange(40)[None], method=model.forward_logits))[0]
    assert ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def test_mpt_with_biases_matches_a_biased_transformers_mpt(tmp_path):
    """MPT with no_bias=false (as llm-foundry writes it): transformers' MptForCausalLM has no bias
    parameters, so they are added to its modules here (random), and the checkpoint carries them."""
    torch.manual_seed(0)
    cls, extra = CONFIGS["mpt_alibi6_clip"]
    hf = tf.MptForCausalLM(cls(**{**BASE, **extra})).eval()
    with torch.no_grad():
        for name, module in list(hf.named_modules()):
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.bias = torch.nn.Parameter(torch.randn(module.out_features) * 0.1)
            elif isinstance(module, torch.nn.LayerNorm):
                module.bias = torch.nn.Parameter(torch.randn(module.normalized_shape) * 0.1)
    hf.config.no_bias = False
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.qkv_bias and cfg.norm_bias and cfg.mlp_bias
    params = load_params(str(tmp_path), cfg)
    tokens = np.random.RandomState(4).randint(0, cfg.vocab_size, (1, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
        unbiased = tf.MptForCausalLM.from_pretrained(str(tmp_path))(torch.tensor(tokens)).logits.numpy()
    assert np.abs(ref - unbiased).max() > 1e-3   # the biases matter
    model = build_model(cfg)
    ours = np.asarray(model.apply({"params": params}, tokens, np.arange(40)[None], method=model.forward_logits))
    assert np.abs(ours - ref).max() < 1e-4


def test_bloom_checkpoint_of_the_base_model_loads(tmp_path):
    """bigscience's BLOOM checkpoints were saved from BloomModel: no "transformer." prefix."""
    from safetensors.numpy import load_file, save_file

    save_hf_model("bloom_alibi6", str(tmp_path / "full"))
    tensors = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert all(name.startswith("transformer.") for name in tensors)
    (tmp_path / "base").mkdir()
    save_file({name.removeprefix("transformer."): x for name, x in tensors.items()},
              str(tmp_path / "base" / "model.safetensors"))
    (tmp_path / "base" / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(str(tmp_path / "full"))
    full, base = (load_params(str(tmp_path / d), cfg) for d in ("full", "base"))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(base)))


def test_learned_positions_bound_max_model_len(tmp_path):
    """A learned position table has no row past its length: a longer max_model_len is refused as the
    engine starts (a lookup past it would read NaN), its own length is served."""
    from jaxserve import LLM

    save_hf_model("gpt_bigcode_mqa", str(tmp_path))
    save_byte_tokenizer(str(tmp_path))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.serving(128).max_position_embeddings == 128
    with pytest.raises(ValueError, match="max_model_len 129 exceeds the model's 128 learned positions"):
        LLM(model=str(tmp_path), max_model_len=129, num_pages=32, compilation_cache_dir=None)


@pytest.mark.parametrize("name", ["gpt_oss", "olmo2", "olmo3_window"])
def test_bfloat16_norms_round_as_the_family_does(name, tmp_path):
    """gpt-oss's and OLMo 2/3's RMSNorms multiply by their weight in float32 and cast once
    (transformers' GptOssRMSNorm, Olmo2RMSNorm), where Llama's casts first: in bf16 our logits
    track transformers' bf16 ones closer with the family's order than with Llama's (measured,
    max abs diff Llama's order -> the family's: gpt_oss 0.69 -> 0.0625, olmo2 0.0996 -> 0.0703,
    olmo3 0.0723 -> 0.0625)."""
    import dataclasses

    hf = save_hf_model(name, str(tmp_path)).to(torch.bfloat16)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert cfg.norm_scale_f32
    params = load_params(str(tmp_path), cfg, jax.numpy.bfloat16)
    tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.float().numpy()
    diffs = []
    for c in (cfg, dataclasses.replace(cfg, norm_scale_f32=False)):
        model = build_model(c, jax.numpy.bfloat16)
        ours = model.apply({"params": params}, tokens, np.broadcast_to(np.arange(40), tokens.shape),
                           method=model.forward_logits)
        diffs.append(np.abs(np.asarray(ours, np.float32) - ref))
    family, llama_order = diffs
    assert family.mean() < llama_order.mean() and family.max() <= llama_order.max(), name
    assert family.max() < 0.08 and np.abs(ref).max() > 1, name
