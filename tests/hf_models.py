"""Small seeded Hugging Face checkpoints for parity tests (written with save_pretrained)."""
import re

import torch
import transformers as tf

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            max_position_embeddings=512, initializer_range=0.1)

CONFIGS = {
    "llama_gqa_rope3": (tf.LlamaConfig, dict(
        num_attention_heads=8, num_key_value_heads=2, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "mistral_window": (tf.MistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),
    "qwen2_bias_tied": (tf.Qwen2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    # head_dim 32 is not hidden_size / heads (16); the q/k norms' weights are spread below.
    "qwen3_qk_norm": (tf.Qwen3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # q, k, v and gate, up fused; 2 kv heads, so k and v rows differ from q's; RoPE on half of
    # each head (Phi-4-mini's partial rotary).
    "phi3_fused": (tf.Phi3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, sliding_window=None,
        partial_rotary_factor=0.5)),
    # Gemma 1: its config.json says hidden_act "gelu", as released (save_hf_model), meaning the tanh
    # approximation; one KV head; head_dim 32, not 64 / 4.
    "gemma_geglu": (tf.GemmaConfig, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32)),
    # Small caps, so both soft caps bite; a 12-token window on every other layer.
    "gemma2_softcap": (tf.Gemma2Config, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=12, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # 3 layers: windowed, windowed, global (pattern 3); both RoPE bases; q/k norms.
    "gemma3_local_global": (tf.Gemma3TextConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}})),
    # Gemma 3 4B and up: the language model of Gemma3ForConditionalGeneration, its tensors under
    # `language_model.`; a small SigLIP tower beside it (not loaded). RoPE scaled on the global layer.
    "gemma3_multimodal": (tf.Gemma3Config, dict(
        text=dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                  sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                  rope_scaling={"rope_type": "linear", "factor": 8.0}),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=255, boi_token_index=253, eoi_token_index=254)),
    # ALiBi with 6 heads (not a power of two: both families' extra-slope rules); BLOOM's
    # interleaved qkv, embedding LayerNorm and biases; MPT's clip_qkv (low enough to bite).
    "bloom_alibi6": (tf.BloomConfig, dict(hidden_size=96, n_head=6)),
    "mpt_alibi6_clip": (tf.MptConfig, dict(hidden_size=96, n_heads=6, attn_config={"clip_qkv": 0.3})),
    # Granite 3's four constants, far enough from 1 to matter.
    "granite_multipliers": (tf.GraniteConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, embedding_multiplier=6.0, residual_multiplier=0.3,
        attention_multiplier=0.09, logits_scaling=4.0, tie_word_embeddings=True)),
    # The rotary LayerNorm families (LayerNorm weights and every bias spread below): GPT-NeoX's
    # parallel block with two norms, RoPE on half of each head; Phi's parallel block with one
    # norm, RoPE on 6 of 16 dims (phi-2's 0.4), a biased LM head; StarCoder 2's GQA, sliding
    # window and tied head.
    "gpt_neox_parallel": (tf.GPTNeoXConfig, dict(num_attention_heads=4, rotary_pct=0.5)),
    "phi_partial": (tf.PhiConfig, dict(num_attention_heads=4, partial_rotary_factor=0.4)),
    # GPTBigCode: 128 learned positions (the engine tests' max_model_len), multi-query attention
    # out of one fused c_attn; a wider init (at 0.1 its greedy continuations collapse to one
    # token) and no eos (min_new_tokens would ban it where these weights pick it).
    "gpt_bigcode_mqa": (tf.GPTBigCodeConfig, dict(n_head=4, max_position_embeddings=128, initializer_range=0.3,
                                                  bos_token_id=None, eos_token_id=None)),
    # GPT-2: Conv1D weights stored [in, out], c_attn's q, k and v as column blocks; the same init and eos.
    "gpt2_conv1d": (tf.GPT2Config, dict(n_head=4, initializer_range=0.3, bos_token_id=None, eos_token_id=None)),
    # GPT-J: RoPE on 8 of each head's 16 dims, in adjacent pairs; Phi's one-norm parallel block.
    "gptj_interleaved": (tf.GPTJConfig, dict(n_head=4, rotary_dim=8, bos_token_id=None, eos_token_id=None)),
    # Llama's gated MLP in the LayerNorm decoder: StableLM's parallel block (one norm) and q/k/v
    # biases, RoPE on a quarter of each head; Cohere's bias-free LayerNorm, parallel block, RoPE in
    # pairs, logit scale; Cohere 2's window on 2 of 3 layers, the third without RoPE.
    # StableLM 2 12B's and Command R+'s q and k LayerNormed per head (their weights spread below)
    "stablelm_qk_layernorm": (tf.StableLmConfig, dict(num_attention_heads=4, num_key_value_heads=2, use_qkv_bias=True,
                                                      use_parallel_residual=True, qk_layernorm=True,
                                                      eos_token_id=None, bos_token_id=None)),
    "cohere_qk_norm": (tf.CohereConfig, dict(num_attention_heads=4, num_key_value_heads=2, logit_scale=0.25,
                                             use_qk_norm=True, pad_token_id=0, eos_token_id=None, bos_token_id=None)),
    "cohere2_window_nope": (tf.Cohere2Config, dict(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                                                   sliding_window=12, sliding_window_pattern=3, logit_scale=0.25,
                                                   pad_token_id=0, eos_token_id=None, bos_token_id=None)),
    "starcoder2_window": (tf.Starcoder2Config, dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
                                                    bos_token_id=1, eos_token_id=2)),
    # GLM: interleaved RoPE on half of each head, q/k/v biases, fused gate_up_proj; GLM-4 adds its
    # norms after each branch (biases and norm weights spread below).
    "glm_interleaved": (tf.GlmConfig, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           pad_token_id=0, eos_token_id=None)),
    "glm4_sandwich": (tf.Glm4Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          pad_token_id=0, eos_token_id=None)),
    # q/k norms over the whole projections (split under TP), norms after each branch only; all
    # norm weights spread below.
    "olmo2": (tf.Olmo2Config, dict(num_attention_heads=4, num_key_value_heads=2)),
    # OLMo 3: OLMo 2's block, a 12-token window on layer 0, RoPE scaled on the global layer only.
    "olmo3_window": (tf.Olmo3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}})),
    # Ministral: Mistral's window on the layers layer_types says (here layer 1 only); transformers needs head_dim.
    "ministral_layer_types": (tf.MinistralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
        layer_types=["full_attention", "sliding_attention"])),
    # SmolLM3: layer 1 without RoPE, windowed; q/k/v/o biases (spread below); tied head.
    "smollm3_nope": (tf.SmolLM3Config, dict(
        num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=12,
        attention_bias=True, pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    # Seed-OSS: q/k/v biased, o not (biases spread below); head_dim 32, not 64 / 4.
    "seed_oss_bias": (tf.SeedOssConfig, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             eos_token_id=None)),
    # Helium: RoPE on adjacent pairs; ERNIE 4.5: the same, every projection biased (spread below), tied.
    "helium_interleaved": (tf.HeliumConfig, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 eos_token_id=None)),
    "ernie4_5_bias": (tf.Ernie4_5Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_bias=True,
                                              eos_token_id=None)),
    # EXAONE 4: per-head q/k norms, norms after each branch only (all spread below); layer 0
    # windowed with RoPE, layer 1 global without it.
    "exaone4_nope": (tf.Exaone4Config, dict(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=12,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=None)),
    "llama_mha": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama_mqa": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=1,
                                       attention_bias=True)),
}

# Mixtures of experts (tests/test_moe.py): 4 experts, 2 a token, a 48-wide expert MLP.
# Qwen3-MoE: experts on layer 1 only (layer 0 in mlp_only_layers keeps a dense MLP), routing
# weights renormalized; Mixtral: experts on every layer, a 12-token sliding window.
MOE_CONFIGS = {
    "qwen3_moe": (tf.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])),
    "mixtral": (tf.MixtralConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, sliding_window=12)),
    # Qwen2-MoE: q/k/v biases (spread below); experts on every 2nd layer (decoder_sparse_step), not
    # renormalized, beside a 32-wide shared expert scaled by its sigmoid gate.
    "qwen2_moe": (tf.Qwen2MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=32, decoder_sparse_step=2)),
    # GLM-4.5: head_dim 32 (q wider than hidden, as GLM-4.5's), RoPE on half of each head rotating its
    # halves, per-head q/k norms and q/k/v biases (spread below); layer 0 dense, then DeepSeek-V3's
    # routing: 8 experts in 2 groups (1 kept a token), a selection bias (spread below), scaled; a shared expert.
    "glm4_moe": (tf.Glm4MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, use_qk_norm=True, attention_bias=True,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        moe_intermediate_size=24, eos_token_id=None, pad_token_id=0)),
    # OLMoE: OLMo 2's whole-projection q/k norms (spread below) before Llama's pre-norms; routing
    # weights not renormalized.
    "olmoe": (tf.OlmoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, intermediate_size=48,
        eos_token_id=None, pad_token_id=0)),
    # gpt-oss: attention sinks, biased q/k/v/o, router and experts (biases spread below), YaRN RoPE
    # (GptOssConfig's: untruncated, 32 x 4096 positions), a 12-token window on layer 0; experts
    # fused, gate and up interleaved; a swiglu_limit low enough to clamp.
    "gpt_oss": (tf.GptOssConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=48, sliding_window=12, swiglu_limit=0.5, max_position_embeddings=131072,
        eos_token_id=None, pad_token_id=0)),
    # DeepSeek-V3: latent attention (q through a rank-24 bottleneck, a rank-32 KV latent, RoPE in
    # pairs on 8 of each head's 16 q/k dims, 12-dim values), YaRN with its mscale_all_dim softmax
    # scale; layer 0 dense, then MoE: 8 experts in 4 groups (2 kept a token), sigmoid scores with a
    # selection bias (spread below), renormalized and scaled, one shared expert.
    "deepseek_v3": (tf.DeepseekV3Config, dict(
        num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "original_max_position_embeddings": 128},
        eos_token_id=None, bos_token_id=None, pad_token_id=0)),
    # DeepSeek-V2-Lite's shape: q_proj without a bottleneck; softmax scores, group-limited (V2's and
    # V2.5's topk_method), not renormalized, scaled; 2 shared experts; q/k latent and o biases (spread below).
    "deepseek_v2_lite": (tf.DeepseekV2Config, dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_shared_experts=2, moe_intermediate_size=24,
        first_k_dense_replace=1, attention_bias=True, eos_token_id=None, bos_token_id=None, pad_token_id=0)),
}


def save_hf_model(name: str, out_dir: str, seed: int = 0, auto_class=tf.AutoModelForCausalLM, **config):
    """Build the named config (with `config`'s overrides) with seeded random weights, as `auto_class`
    (e.g. AutoModelForSequenceClassification), save_pretrained it, return the model."""
    cls, extra = {**CONFIGS, **MOE_CONFIGS}[name]
    torch.manual_seed(seed)
    if "text" in extra:   # a multimodal model: BASE shapes its language model
        extra = dict(extra)
        cfg = cls(text_config={**BASE, **extra.pop("text")}, **extra, **config)
    else:
        cfg = cls(**{**BASE, **extra, **config})
    model = auto_class.from_config(cfg, attn_implementation="eager").eval()
    if name == "qwen2_bias_tied":  # biases are zero-initialised: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if name.startswith("gemma"):  # norm weights start at zero (a scale of one): make them matter
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if name_.endswith("norm.weight"):
                    p.normal_(0, 0.5)
    if name == "qwen3_qk_norm":  # norm weights start at one: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    if name in ("olmo2", "olmoe"):  # norm weights start at one: make them matter
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if name_.endswith("norm.weight"):
                    p.normal_(1, 0.5)
    if name in ("deepseek_v3", "glm4_moe"):   # the selection bias (a buffer) starts at zero: make it matter
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    if name in ("deepseek_v3", "deepseek_v2_lite", "glm4_moe", "qwen2_moe", "gpt_oss", "gpt_neox_parallel", "phi_partial",
                "starcoder2_window", "gpt_bigcode_mqa", "gpt2_conv1d", "gptj_interleaved", "glm_interleaved", "glm4_sandwich", "olmo3_window",
                "smollm3_nope", "seed_oss_bias", "helium_interleaved", "ernie4_5_bias", "exaone4_nope", "stablelm_qk_layernorm",
                "cohere_qk_norm", "cohere2_window_nope"):
        # norms start at (1, 0), biases at 0: make them matter
        with torch.no_grad():
            for name_, p in model.named_parameters():
                if re.search(r"norms?(\.\d+)?\.weight$", name_):   # StableLM's per-head q_layernorm.norms.<h>
                    p.normal_(1, 0.5)
                elif name_.endswith("bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    if name == "gemma_geglu":   # as Gemma 1 was released (transformers writes the value it reads it as)
        import json
        import os

        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump({**cfg, "hidden_act": "gelu"}, f)
    return model


def hf_greedy(hf, ids: list[int], n: int, adjust=lambda step, logits: logits) -> tuple[list[int], list[float]]:
    """n greedy tokens after `ids` in transformers, `adjust(step, logits)` editing each step's
    logits, and the tokens' logprobs under the unedited logits."""
    ids, out, logprobs = list(ids), [], []
    with torch.no_grad():
        for step in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            out.append(int(adjust(step, logits.clone()).argmax()))
            logprobs.append(float(torch.log_softmax(logits, -1)[out[-1]]))
            ids.append(out[-1])
    return out, logprobs


def save_byte_tokenizer(out_dir: str) -> None:
    """A byte-level tokenizer.json: ids 0-255 are bytes, 256 is <s>, 257 is </s>."""
    import json
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: bytes(c, "utf-8")))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
                                    "{% if note is defined %}note: {{ note }}\n{% endif %}"
                                    # as gpt-oss's system message
                                    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                                    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                                    "{% if m.tool_calls %} calls: {{ m.tool_calls | tojson }}{% endif %}"
                                    "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
                                    # as Qwen3's: thinking turned off is an empty think block
                                    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and "
                                    "not enable_thinking %}<think></think>{% endif %}{% endif %}"}, f)


def save_engine_model(out_dir: str, seed: int = 0, **overrides):
    """A random Llama (GQA) with a byte tokenizer, for engine and server tests."""
    torch.manual_seed(seed)
    kw = dict(BASE, vocab_size=258, num_attention_heads=4, num_key_value_heads=2, bos_token_id=256,
              eos_token_id=257, max_position_embeddings=512)
    kw.update(overrides)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw)).eval()
    model.save_pretrained(out_dir)
    save_byte_tokenizer(out_dir)
    return model
