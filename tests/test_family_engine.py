"""Every registered architecture served through the engine, as users load it (`LLM(model=DIR)`):
paged KV cache, prompts split into chunks, a shared prefix found in the prefix cache, on one
device and under tensor parallelism (fake CPU devices, in a subprocess). Greedy continuations
must equal transformers' generate on the same seeded checkpoint."""
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers as tf

from tests.conftest import fake_devices_env
from tests.engine_runs import NEW_TOKENS, _prompts, engine_tokens
from tests.hf_models import CONFIGS, save_byte_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Under TP, one checkpoint per family, each at one mesh, TP 2 and TP 4 alternating in name order:
# llama_mqa's one KV head and the 2 KV heads of the TP-4 families are replicated, and the two
# 6-head ALiBi families take one mesh each. The other Llama variants (Granite's: scalar constants),
# Gemma 1 (Gemma 2's options but fewer), Gemma 3's multimodal checkpoint (Gemma 3's module under
# other tensor names), GPT-NeoX (BLOOM's fused projection, Phi's parallel block) and StarCoder 2
# (BLOOM's MLP biases, Mistral's window), GPTBigCode (GPT-2's table, MPT's fused rows, llama_mqa's
# one KV head), GPT-J (Phi's block; its RoPE pairs stay within a head) and GLM (Phi-3's fused MLP,
# Gemma 2's norms), OLMo 3 (OLMo 2's sharded q/k norms, Mistral's windows), Ministral, Seed-OSS, Helium,
# ERNIE 4.5 (Llama's projections, biased or not; GLM's RoPE pairs), SmolLM3 and EXAONE 4 (NoPE layers,
# Qwen3's per-head norms), StableLM (Command R+'s per-head q/k LayerNorms, split with their heads)
# and Cohere 2 (Llama's MLP under Llama's rules, Phi's block) change nothing that is sharded.
TP_SKIP = {"llama_mha", "llama_gqa_rope3", "granite_multipliers", "gemma_geglu", "gemma3_multimodal",
           "gpt_neox_parallel", "starcoder2_window", "gpt_bigcode_mqa", "gptj_interleaved", "glm_interleaved",
           "glm4_sandwich", "olmo3_window", "ministral_layer_types", "smollm3_nope", "seed_oss_bias",
           "helium_interleaved", "ernie4_5_bias", "exaone4_nope", "stablelm_qk_layernorm", "cohere2_window_nope"}


def tp_meshes(names) -> dict[str, dict]:
    return {name: {"model": 2 if i % 2 == 0 else 4} for i, name in enumerate(sorted(names))}


def save_with_greedy(name: str, d: str) -> list[list[int]]:
    """Save the named seeded checkpoint (tests/hf_models.py) and a byte tokenizer in `d`; return
    transformers' greedy tokens for the prompts."""
    hf = save_hf_model(name, d)
    save_byte_tokenizer(d)
    # No eos: like ignore_eos, generation runs through it (min_new_tokens would ban it instead).
    hf.generation_config.eos_token_id = None
    greedy = tf.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = []
    for p in _prompts(hf.config.get_text_config().vocab_size):
        ids = torch.tensor([p])   # the mask is explicit: generate would mask a prompt's pad-id tokens
        with torch.no_grad():
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids),
                                        generation_config=greedy)[0, len(p):].tolist())
    assert len({tuple(e) for e in expected}) == len(expected), name  # continuations differ
    return expected


def tensor_parallel_tokens(dirs: dict[str, str]) -> dict[str, list[list[int]]]:
    """"name@mesh" -> the engine's greedy tokens at the name's tp_meshes mesh, on fake CPU devices
    in a subprocess (this file's main)."""
    proc = subprocess.run([sys.executable, "-m", "tests.test_family_engine", json.dumps(dirs)], cwd=ROOT,
                          capture_output=True, text=True, env=fake_devices_env(4), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(dirs)
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """name -> (model dir, transformers' greedy tokens for the prompts)."""
    out = {}
    for name in sorted(CONFIGS):
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, save_with_greedy(name, d))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_greedy_matches_transformers(name, checkpoints):
    model_dir, expected = checkpoints[name]
    tokens, hit_rate = engine_tokens(model_dir)
    assert tokens == expected, name
    assert hit_rate > 0   # the shared prefix came from the cache


def test_tensor_parallel_matches_transformers(checkpoints):
    """Every family at TP 2 or TP 4 (4 heads, 2 kv heads: K/V replicated at TP 4)."""
    dirs = {name: d for name, (d, _) in checkpoints.items() if name not in TP_SKIP}
    assert {mesh["model"] for mesh in tp_meshes(dirs).values()} == {2, 4}
    for case, tokens in tensor_parallel_tokens(dirs).items():
        assert tokens == checkpoints[case.split("@")[0]][1], case


if __name__ == "__main__":   # the TP runs, on the fake devices of this process
    dirs = json.loads(sys.argv[1])
    print(json.dumps({f"{name}@{json.dumps(mesh)}": engine_tokens(dirs[name], mesh=mesh)[0]
                      for name, mesh in tp_meshes(dirs).items()}))
