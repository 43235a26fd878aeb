"""The model families (one file each) and their registry, keyed by HF architecture name."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.config import ModelConfig
from jaxserve.models.registry import architecture


def model_class(cfg: ModelConfig):
    return architecture(cfg.architecture).module


def build_model(cfg: ModelConfig, dtype=jnp.float32):
    return model_class(cfg)(cfg, dtype)


def init_params(cfg: ModelConfig, rng: jax.Array, dtype=jnp.float32):
    """Random parameters (training from scratch, benchmarks on random weights)."""
    model = build_model(cfg, dtype)
    tokens = jnp.zeros((1, 8), jnp.int32)
    return model.init(rng, tokens, tokens, method=model.forward_logits)["params"]
