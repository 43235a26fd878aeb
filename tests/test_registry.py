"""The registry is the single source of family knowledge: every registered architecture has a
parity checkpoint (tests/test_models.py runs it against transformers), and its name map and
sharding rules cover its parameters, and its name map works both ways: our save_pretrained
writes the very tensors transformers wrote, transformers loads them to the same logits, and
our load of them gives those logits too. A family's sequence classifier is its transformer and a
score head."""
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve import checkpoint, parallel, pooling
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import build_model
from jaxserve.models.registry import ARCHITECTURES
from tests.hf_models import CONFIGS, MOE_CONFIGS, save_hf_model

ALL_CONFIGS = {**CONFIGS, **MOE_CONFIGS}   # the mixtures of experts' parity checks: tests/test_moe.py


def hf_architecture(config_name: str) -> str:
    return tf.MODEL_FOR_CAUSAL_LM_MAPPING[ALL_CONFIGS[config_name][0]].__name__


def test_every_architecture_has_a_parity_checkpoint():
    assert {hf_architecture(name) for name in ALL_CONFIGS} == set(ARCHITECTURES)


def test_readme_lists_every_architecture():
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        readme = f.read()
    assert [a for a in sorted(ARCHITECTURES) if f"`{a}`" not in readme] == []


def _tensors(model_dir):
    from safetensors.numpy import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_save_pretrained_round_trips_through_transformers(arch, tmp_path):
    name = next(n for n in sorted(ALL_CONFIGS) if hf_architecture(n) == arch)
    src, dst = str(tmp_path / "hf"), str(tmp_path / "ours")
    hf = save_hf_model(name, src)
    with open(os.path.join(src, "config.json")) as f:
        hf_config = json.load(f)
    cfg = ModelConfig.from_hf_dict(hf_config)
    assert cfg.architecture == arch
    params = checkpoint.load_params(src, cfg)

    axes = parallel.param_logical_axes(params, cfg)
    for a, p in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(params)):
        assert len(a) == p.ndim and all(n in parallel.LOGICAL_RULES for n in a)

    checkpoint.save_pretrained(params, hf_config, dst)
    # A multimodal checkpoint's vision tower is not loaded (nor written back): the text is the same.
    theirs = {k: v for k, v in _tensors(src).items() if not k.startswith(("vision_tower.", "multi_modal_projector."))}
    ours = _tensors(dst)
    assert sorted(ours) == sorted(theirs)
    assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)

    reloaded = tf.AutoModelForCausalLM.from_pretrained(dst, attn_implementation="eager").eval()
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 24))
    with torch.no_grad():
        ref = reloaded(torch.tensor(tokens)).logits
        assert torch.equal(ref, hf(torch.tensor(tokens)).logits)
    again = checkpoint.load_params(dst, cfg)
    model = build_model(cfg)
    logits = model.apply({"params": again}, tokens, np.arange(24)[None], method=model.forward_logits)
    assert np.abs(np.asarray(logits) - ref.numpy()).max() < 1e-4


def test_gemma3_multimodal_text_config_as_published(tmp_path):
    """Gemma 3 4B's config.json keeps in text_config only what differs from Gemma3TextConfig's
    defaults (heads, head_dim, vocabulary, RoPE bases, window pattern are absent): read as
    transformers reads it."""
    published = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "eos_token_id": [1, 106], "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024},
                 "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                                   "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                                   "patch_size": 14, "vision_use_head": False}}
    with open(tmp_path / "config.json", "w") as f:
        json.dump(published, f)
    text = tf.AutoConfig.from_pretrained(str(tmp_path)).text_config
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    assert (cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (
        text.vocab_size, text.num_attention_heads, text.num_key_value_heads, text.head_dim, 34)
    assert cfg.sliding_windows == tuple(1024 if t == "sliding_attention" else None for t in text.layer_types)
    assert cfg.sliding_windows.count(None) == 5   # every sixth layer is global
    assert cfg.attn_scale == text.query_pre_attn_scalar ** -0.5 and cfg.rms_norm_eps == text.rms_norm_eps
    assert cfg.rope_theta == text.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.local_rope_theta == text.rope_parameters["sliding_attention"]["rope_theta"]
    assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 8.0)
    assert cfg.max_position_embeddings == text.max_position_embeddings and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (1, 106)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sequence_classifiers_are_their_transformer_and_a_score_head(arch, tmp_path):
    """transformers' XForSequenceClassification of each family that has one: runner auto pools it,
    its transformer loads through the family's name map, and the score head (jaxserve/pooling.py)
    on our last final hidden state gives transformers' logits."""
    name = next(n for n in sorted(ALL_CONFIGS) if hf_architecture(n) == arch)
    hf_config = ALL_CONFIGS[name][0]
    if hf_config not in tf.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING:
        pytest.skip(f"transformers has no sequence classifier for {hf_config.__name__}")
    path = str(tmp_path)
    hf = save_hf_model(name, path, auto_class=tf.AutoModelForSequenceClassification, num_labels=3, pad_token_id=None)
    ecfg, cfg, pooler = pooling.configure(EngineConfig(model=path), path)
    assert ecfg.runner == "pooling" and pooler.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
    model = build_model(cfg)
    tokens = np.random.RandomState(0).randint(1, cfg.vocab_size, (1, 12))
    hidden, _ = model.apply({"params": checkpoint.load_params(path, cfg)}, tokens, np.arange(12)[None])
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits[0].numpy()
    np.testing.assert_allclose(pooler.classifier @ np.asarray(hidden[0, -1]), want, atol=1e-4)
