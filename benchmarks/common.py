"""Shared by the benchmarks: the models they run (the embedded tiny model, a random ~100M Llama),
seeded random-token workloads, and a description of the machine.

  100m: hidden 768, 12 layers, 12 heads / 4 KV heads, ffn 2048, vocab 32000, tied embeddings
        -> 100.1M parameters, float32, seeded random weights written with save_pretrained.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.engine import TINY_MODEL_DIR

LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.02)
MODEL_NAMES = ("tiny", "100m")


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[Request]:
    """Prompts of seeded random token ids (ids 0-2 left out: unk/bos/eos in both models) with
    input and output lengths drawn uniformly from the inclusive ranges."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_range[0], input_range[1] + 1, num_prompts)
    outs = rng.integers(output_range[0], output_range[1] + 1, num_prompts)
    return [Request(rng.integers(3, vocab_size, n).tolist(), int(m)) for n, m in zip(ins, outs)]


def prepare_model(name: str, work_dir: str) -> str:
    """The model directory of `name` (HF format): 'tiny', '100m' (built once under work_dir) or the
    path of a Hugging Face model directory."""
    if os.path.isdir(name):
        return name
    if name == "tiny":
        return TINY_MODEL_DIR
    if name != "100m":
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES} or a model directory")
    out_dir = os.path.join(work_dir, "llama-100m")
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        import torch
        import transformers as tf

        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_100M))
        model.save_pretrained(out_dir)
        save_word_tokenizer(out_dir, LLAMA_100M["vocab_size"])
    return out_dir


def save_word_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer.json covering every id of a random model: id i is the word `w{i}`,
    0-2 are <unk>, <s>, </s> (the engine detokenizes whatever ids the model samples)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>", "pad_token": "<unk>"}, f)


def load_hf_model(model_dir: str):
    """The same weights in transformers, float32, eval mode."""
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def model_summary(model_dir: str) -> str:
    c = ModelConfig.from_pretrained(model_dir)
    return (f"{c.num_params:,} parameters: hidden {c.hidden_size}, {c.num_layers} layers, "
            f"{c.num_heads}/{c.num_kv_heads} heads, ffn {c.intermediate_size}, vocab {c.vocab_size}")


def machine_info() -> dict[str, str]:
    """What the figures were measured on."""
    import jax
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    devices = jax.devices()
    accel = "none" if devices[0].platform == "cpu" else f"{len(devices)} x {devices[0].device_kind}"
    return {"cpu": f"{cpu}, {os.cpu_count()} cores", "accelerator": accel,
            "load average (1 min) at start": f"{os.getloadavg()[0]:.1f}",
            "python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}
