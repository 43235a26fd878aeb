"""Model registry: Hugging Face `architectures` name -> Flax module class."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig):
    try:
        return MODEL_REGISTRY[cfg.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {cfg.architecture!r}; supported: "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


def build_model(cfg: ModelConfig, dtype=jnp.float32):
    return model_class(cfg)(cfg, dtype)


def init_params(cfg: ModelConfig, rng: jax.Array, dtype=jnp.float32):
    """Random parameters (training from scratch, benchmarks on random weights)."""
    model = build_model(cfg, dtype)
    tokens = jnp.zeros((1, 8), jnp.int32)
    return model.init(rng, tokens, tokens, method=model.forward_logits)["params"]
