"""The registry is the single source of family knowledge: every registered architecture has a
parity checkpoint (tests/test_models.py runs it against transformers), and its name map and
sharding rules cover its parameters, and its name map works both ways: our save_pretrained
writes the very tensors transformers wrote, transformers loads them to the same logits, and
our load of them gives those logits too."""
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve import checkpoint, parallel
from jaxserve.config import ModelConfig
from jaxserve.models import build_model
from jaxserve.models.registry import ARCHITECTURES
from tests.hf_models import CONFIGS, save_hf_model


def hf_architecture(config_name: str) -> str:
    return tf.MODEL_FOR_CAUSAL_LM_MAPPING[CONFIGS[config_name][0]].__name__


def test_every_architecture_has_a_parity_checkpoint():
    assert {hf_architecture(name) for name in CONFIGS} == set(ARCHITECTURES)


def _tensors(model_dir):
    from safetensors.numpy import load_file
    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_save_pretrained_round_trips_through_transformers(arch, tmp_path):
    name = next(n for n in sorted(CONFIGS) if hf_architecture(n) == arch)
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
    theirs, ours = _tensors(src), _tensors(dst)
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
