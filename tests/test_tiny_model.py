"""The embedded tiny models (jaxserve/assets/tiny and tiny/draft) against transformers, and a
smoke run of the script that trains them."""
import filecmp
import importlib.util
import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.generate import greedy_generate
from jaxserve.tokenizer import SentencePieceTokenizer, load_tokenizer

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY_DIR = os.path.join(ROOT, "jaxserve", "assets", "tiny")
DRAFT_DIR = os.path.join(TINY_DIR, "draft")
PROMPTS = [
    "The try statement specifies",
    "A class definition defines a class object",
    "Lists are mutable sequences, typically used to",
    "def f(x):\n    return",
]
CHAT = [{"role": "user", "content": "Tell me about the while statement."}]
NEW_TOKENS = 24


def read_json(path):
    with open(path) as f:
        return json.load(f)


def prompt_ids(tokenizer):
    ids = [tokenizer.encode(p) for p in PROMPTS]
    return ids + [tokenizer.encode(tokenizer.apply_chat_template(CHAT), add_special_tokens=False)]


def hf_greedy(model, ids, eos):
    """transformers' greedy tokens, cut after the first eos (generate stops there)."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=eos)
    return out[0, len(ids):].tolist()


def cut_at_eos(tokens, eos):
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("model_dir", [TINY_DIR, DRAFT_DIR], ids=["main", "draft"])
def test_greedy_tokens_match_transformers(model_dir):
    tokenizer = load_tokenizer(model_dir)
    hf_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = prompt_ids(tokenizer)
    assert prompts[:len(PROMPTS)] == [hf_tokenizer.encode(p) for p in PROMPTS]
    assert prompts[-1] == hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                           tokenize=True, return_dict=False)
    cfg = ModelConfig.from_pretrained(model_dir)
    ours = greedy_generate(cfg, load_params(model_dir, cfg), prompts, NEW_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_ids[0]
    with torch.no_grad():
        for ids, tokens in zip(prompts, ours):
            assert cut_at_eos(tokens, eos) == hf_greedy(model, ids, eos)
    if model_dir == TINY_DIR:  # a trained model continues a documentation sentence with words
        text = tokenizer.decode(ours[0])
        assert sum(c.isalpha() or c == " " for c in text) > 0.8 * len(text), text


def test_assets_are_consistent():
    main_cfg, draft_cfg = read_json(os.path.join(TINY_DIR, "config.json")), read_json(os.path.join(DRAFT_DIR, "config.json"))
    tokenizer = load_tokenizer(TINY_DIR)
    for d, cfg in ((TINY_DIR, main_cfg), (DRAFT_DIR, draft_cfg)):
        gen = read_json(os.path.join(d, "generation_config.json"))
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["bos_token_id"] == gen["bos_token_id"] == tokenizer.bos_token_id
        assert [cfg["eos_token_id"]] == [gen["eos_token_id"]] == tokenizer.eos_token_ids
        assert cfg["vocab_size"] == tokenizer.vocab_size
        for fn in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
            assert filecmp.cmp(os.path.join(TINY_DIR, fn), os.path.join(d, fn), shallow=False)
        with safe_open(os.path.join(d, "model.safetensors"), framework="np") as f:
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    assert ModelConfig.from_hf_dict(main_cfg).num_kv_heads < ModelConfig.from_hf_dict(main_cfg).num_heads
    main_n = ModelConfig.from_hf_dict(main_cfg).num_params
    draft_n = ModelConfig.from_hf_dict(draft_cfg).num_params
    assert 5e6 <= main_n <= 15e6 and draft_n < main_n / 3
    total = sum(os.path.getsize(os.path.join(root, fn)) for root, _, fns in os.walk(TINY_DIR) for fn in fns)
    assert total <= 25e6
    # Every role the chat template uses is one token.
    for role in ("<|system|>", "<|user|>", "<|assistant|>"):
        assert len(tokenizer.encode(role, add_special_tokens=False)) == 1


def test_sentencepiece_file_encodes_like_transformers(tmp_path):
    for fn in ("tokenizer.model", "tokenizer_config.json"):
        os.symlink(os.path.join(os.path.abspath(TINY_DIR), fn), tmp_path / fn)
    sp = load_tokenizer(str(tmp_path))
    assert isinstance(sp, SentencePieceTokenizer)
    assert prompt_ids(sp) == prompt_ids(load_tokenizer(TINY_DIR))


def test_training_script_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tiny_model", os.path.join(ROOT, "scripts", "train_tiny_model.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny"
    script.main(["--smoke", "--out", str(out), "--topics", "11", "--vocab-size", "512", "--steps", "2",
                 "--draft-steps", "2", "--batch-size", "2", "--seq-len", "16", "--log-every", "1",
                 "--eval-every", "2", "--sample-tokens", "2"])
    log = (out / "TRAINING.md").read_text()
    assert "held-out ppl" in log and "Greedy samples" in log
    for d in (out, out / "draft"):
        cfg = ModelConfig.from_pretrained(str(d))
        params = load_params(str(d), cfg)
        model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
        assert sum(p.numel() for p in model.parameters()) == sum(np.size(x) for x in jax.tree.leaves(params))
        assert AutoTokenizer.from_pretrained(str(d)).encode("The for statement") == load_tokenizer(str(d)).encode("The for statement")
