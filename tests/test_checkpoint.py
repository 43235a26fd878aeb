"""Checkpoint loading: sharded safetensors, orbax round trip, bf16, and clear errors on bad input."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve.checkpoint import convert_to_orbax, load_params
from jaxserve.config import ModelConfig
from jaxserve.models import model_class
from tests.hf_models import save_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    save_hf_model("llama_gqa_rope3", d)
    return d


def _rewrite(src, dst, edit):
    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def _leaves_equal(a, b):
    import jax
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_sharded_safetensors_with_index(hf_dir, tmp_path):
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fn, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / fn))
    index = {"weight_map": {k: fn for fn, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(open(os.path.join(hf_dir, "config.json")).read())
    cfg = ModelConfig.from_pretrained(hf_dir)
    assert _leaves_equal(load_params(str(tmp_path), cfg), load_params(hf_dir, cfg))


def test_orbax_round_trip(hf_dir, tmp_path):
    cfg = ModelConfig.from_pretrained(hf_dir)
    out = convert_to_orbax(hf_dir, str(tmp_path / "orbax_copy"))
    assert os.path.exists(os.path.join(out, "config.json"))
    assert not any(f.endswith(".safetensors") for f in os.listdir(out))
    assert _leaves_equal(load_params(out, cfg), load_params(hf_dir, cfg))


def test_bfloat16_load(hf_dir):
    cfg = ModelConfig.from_pretrained(hf_dir)
    p32, p16 = load_params(hf_dir, cfg), load_params(hf_dir, cfg, dtype=jnp.bfloat16)
    import jax
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
    err = max(float(jnp.abs(a.astype(jnp.float32) - b).max()) for a, b in zip(jax.tree.leaves(p16), jax.tree.leaves(p32)))
    assert 0 < err < 1e-2


def test_missing_tensor_is_named(hf_dir, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    d = _rewrite(hf_dir, str(tmp_path / "missing"), lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'.*\(128, 64\)"):
        load_params(d, ModelConfig.from_pretrained(d))


def test_wrong_shape_names_both_shapes(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    d = _rewrite(hf_dir, str(tmp_path / "shape"), lambda t: t.__setitem__(name, np.zeros((8, 64), np.float32)))
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(8, 64\).*expected \(16, 64\)"):
        load_params(d, ModelConfig.from_pretrained(d))


def test_unknown_architecture_lists_supported(tmp_path):
    t5 = dict(architectures=["T5ForConditionalGeneration"], vocab_size=10, hidden_size=8, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=2)
    supported = "T5ForConditionalGeneration.*GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"
    with pytest.raises(ValueError, match=supported):   # parsing the config.json
        ModelConfig.from_hf_dict(t5)
    cfg = ModelConfig(architecture="T5ForConditionalGeneration", vocab_size=10, hidden_size=8, intermediate_size=8,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match=supported):   # building the model of a config made by hand
        model_class(cfg)


@pytest.mark.parametrize("hf", [
    dict(architectures=["LlamaForCausalLM"], hidden_act="relu2", vocab_size=10, hidden_size=8, intermediate_size=8,
         num_hidden_layers=1, num_attention_heads=2),
    dict(architectures=["GPT2LMHeadModel"], activation_function="relu", vocab_size=10, n_embd=8, n_layer=1, n_head=2),
    dict(architectures=["PhiForCausalLM"], hidden_act="gelu_fast", vocab_size=10, hidden_size=8, intermediate_size=8,
         num_hidden_layers=1, num_attention_heads=2)])
def test_unsupported_activation_is_refused_as_the_config_is_read(hf):
    act = hf.get("hidden_act") or hf["activation_function"]
    with pytest.raises(ValueError, match=f"unsupported activation '{act}'.*gelu_pytorch_tanh"):
        ModelConfig.from_hf_dict(hf)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_params(str(tmp_path), ModelConfig.from_hf_dict(dict(
            architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=8,
            num_hidden_layers=1, num_attention_heads=2)))
