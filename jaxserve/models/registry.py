"""Hugging Face architecture name -> everything the engine needs to know about its family.

A family lives in one file of `jaxserve/models/` and brings four things, gathered here:
  * `parse_config`: config.json dict -> ModelConfig (the family's own key names and quirks);
  * `module`: the Flax module class, built as `module(cfg, dtype)`;
  * `hf_tensor`: (Flax param path, ModelConfig) -> (HF tensor name, rows), rows (start, stop)
    along the HF tensor's first axis when the param is part of a fused tensor (Phi-3's qkv_proj
    and MPT's Wqkv hold q, k and v), a moe.Interleaved when its rows alternate with another
    param's in it (gpt-oss's gate_up_proj), else None (checkpoint loading and save_pretrained); a
    tuple of names for a param stacked from several tensors along its first axis (MoE experts);
  * `param_axes`: param path suffix -> logical axes (parallel.py maps them to mesh axes);
  * `conv1d`: the checkpoint stores its projections' weights [in, out] (GPT-2's Conv1D), so
    they are read and written transposed (`stored_transposed`); `experts_transposed`: its
    stacked experts' weights [experts, in, out] (gpt-oss's).
Adding a family is one file in `models/` and its entries below; nothing outside `models/` changes.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn

from jaxserve.config import ModelConfig
from jaxserve.models import (bloom, cohere, deepseek, gemma, glm, gpt2, gpt_neox, gpt_oss, gptj, llama, llama_variants,
                             moe, mpt, olmo2, phi, phi3, stablelm, starcoder2)
from jaxserve.models.layernorm_decoder import PARAM_AXES as LAYERNORM_AXES, LayerNormForCausalLM
from jaxserve.models.layers import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class Architecture:
    # (config.json dict, the fields every HF config spells alike) -> ModelConfig
    parse_config: Callable[[dict[str, Any], dict[str, Any]], ModelConfig]
    module: type[nn.Module]
    hf_tensor: Callable[[tuple[str, ...], ModelConfig],
                        tuple[str | tuple[str, ...], tuple[int, int] | moe.Interleaved | None]]
    param_axes: dict[tuple[str, ...], tuple[str, ...]]
    conv1d: bool = False
    experts_transposed: bool = False
    # The reasoning parser the family's text is read with unless another is named (jaxserve/cli.py):
    # gpt-oss writes harmony messages, never meant to be returned raw.
    reasoning_parser: str | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "BloomForCausalLM": Architecture(bloom.bloom_config, LayerNormForCausalLM, bloom.hf_tensor, LAYERNORM_AXES),
    "CohereForCausalLM": Architecture(cohere.cohere_config, LayerNormForCausalLM, llama.hf_tensor, LAYERNORM_AXES),
    "Cohere2ForCausalLM": Architecture(cohere.cohere2_config, LayerNormForCausalLM, llama.hf_tensor, LAYERNORM_AXES),
    "DeepseekV2ForCausalLM": Architecture(deepseek.deepseek_v2_config, llama.LlamaForCausalLM, deepseek.hf_tensor,
                                          deepseek.PARAM_AXES),
    "DeepseekV3ForCausalLM": Architecture(deepseek.deepseek_v3_config, llama.LlamaForCausalLM, deepseek.hf_tensor,
                                          deepseek.PARAM_AXES),
    "Ernie4_5ForCausalLM": Architecture(llama_variants.ernie4_5_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                        llama.PARAM_AXES),
    "Exaone4ForCausalLM": Architecture(llama_variants.exaone4_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                       llama.PARAM_AXES),
    "GemmaForCausalLM": Architecture(gemma.gemma_config, llama.LlamaForCausalLM, llama.hf_tensor, llama.PARAM_AXES),
    "Gemma2ForCausalLM": Architecture(gemma.gemma2_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                      llama.PARAM_AXES),
    "Gemma3ForCausalLM": Architecture(gemma.gemma3_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                      llama.PARAM_AXES),
    "Gemma3ForConditionalGeneration": Architecture(gemma.gemma3_multimodal_config, llama.LlamaForCausalLM,
                                                   gemma.multimodal_hf_tensor, llama.PARAM_AXES),
    "GPT2LMHeadModel": Architecture(gpt2.gpt2_config, LayerNormForCausalLM, gpt2.hf_tensor, LAYERNORM_AXES,
                                    conv1d=True),
    "GPTBigCodeForCausalLM": Architecture(gpt2.gpt_bigcode_config, LayerNormForCausalLM, gpt2.hf_tensor,
                                          LAYERNORM_AXES),
    "GlmForCausalLM": Architecture(glm.glm_config, llama.LlamaForCausalLM, glm.hf_tensor, llama.PARAM_AXES),
    "Glm4ForCausalLM": Architecture(glm.glm4_config, llama.LlamaForCausalLM, glm.hf_tensor, llama.PARAM_AXES),
    "Glm4MoeForCausalLM": Architecture(glm.glm4_moe_config, llama.LlamaForCausalLM, deepseek.hf_tensor,
                                       deepseek.PARAM_AXES),
    "GptOssForCausalLM": Architecture(gpt_oss.gpt_oss_config, llama.LlamaForCausalLM, gpt_oss.hf_tensor,
                                      gpt_oss.PARAM_AXES, experts_transposed=True, reasoning_parser="openai_gptoss"),
    "GPTJForCausalLM": Architecture(gptj.gptj_config, LayerNormForCausalLM, gptj.hf_tensor, LAYERNORM_AXES),
    "GPTNeoXForCausalLM": Architecture(gpt_neox.gpt_neox_config, LayerNormForCausalLM, gpt_neox.hf_tensor,
                                       LAYERNORM_AXES),
    "GraniteForCausalLM": Architecture(llama.granite_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                       llama.PARAM_AXES),
    "HeliumForCausalLM": Architecture(llama_variants.helium_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                      llama.PARAM_AXES),
    "LlamaForCausalLM": Architecture(llama.llama_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                     llama.PARAM_AXES),
    "MistralForCausalLM": Architecture(llama.mistral_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                       llama.PARAM_AXES),
    "MinistralForCausalLM": Architecture(llama.ministral_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                         llama.PARAM_AXES),
    "Qwen2ForCausalLM": Architecture(llama.qwen2_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                     llama.PARAM_AXES),
    "MixtralForCausalLM": Architecture(moe.mixtral_config, llama.LlamaForCausalLM, moe.mixtral_hf_tensor,
                                       moe.PARAM_AXES),
    "MptForCausalLM": Architecture(mpt.mpt_config, LayerNormForCausalLM, mpt.hf_tensor, LAYERNORM_AXES),
    "OlmoeForCausalLM": Architecture(moe.olmoe_config, llama.LlamaForCausalLM, moe.qwen3_moe_hf_tensor,
                                     moe.OLMOE_PARAM_AXES),
    "Olmo2ForCausalLM": Architecture(olmo2.olmo2_config, llama.LlamaForCausalLM, llama.hf_tensor, olmo2.PARAM_AXES),
    "Olmo3ForCausalLM": Architecture(olmo2.olmo3_config, llama.LlamaForCausalLM, llama.hf_tensor, olmo2.PARAM_AXES),
    "PhiForCausalLM": Architecture(phi.phi_config, LayerNormForCausalLM, phi.hf_tensor, LAYERNORM_AXES),
    "Phi3ForCausalLM": Architecture(phi3.phi3_config, llama.LlamaForCausalLM, phi3.hf_tensor, llama.PARAM_AXES),
    "Qwen3ForCausalLM": Architecture(llama.qwen3_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                     llama.PARAM_AXES),
    "Qwen2MoeForCausalLM": Architecture(moe.qwen2_moe_config, llama.LlamaForCausalLM, moe.qwen2_moe_hf_tensor,
                                        moe.QWEN2_MOE_PARAM_AXES),
    "Qwen3MoeForCausalLM": Architecture(moe.qwen3_moe_config, llama.LlamaForCausalLM, moe.qwen3_moe_hf_tensor,
                                        moe.PARAM_AXES),
    "SeedOssForCausalLM": Architecture(llama_variants.seed_oss_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                       llama.PARAM_AXES),
    "SmolLM3ForCausalLM": Architecture(llama_variants.smollm3_config, llama.LlamaForCausalLM, llama.hf_tensor,
                                       llama.PARAM_AXES),
    "StableLmForCausalLM": Architecture(stablelm.stablelm_config, LayerNormForCausalLM, stablelm.hf_tensor,
                                        LAYERNORM_AXES),
    "Starcoder2ForCausalLM": Architecture(starcoder2.starcoder2_config, LayerNormForCausalLM, starcoder2.hf_tensor,
                                          LAYERNORM_AXES),
}


# The heads besides the LM head that a family's transformer may carry, as the causal LM's
# architecture serves them: none (XModel, as embedding models ship) and a sequence classifier
# (XForSequenceClassification: a `score` Linear on the last token's final hidden state,
# jaxserve/pooling.py). Both run on the pooling runner.
POOLING_SUFFIXES = ("Model", "ForSequenceClassification")
# The pooling architectures whose transformer is another architecture's than their name says: Gemma
# 3's classifier (multimodal) holds Gemma3ForConditionalGeneration's tensors, its text-only one
# Gemma3ForCausalLM's; GPT-2's causal LM is GPT2LMHeadModel.
CLASSIFIER_TRANSFORMERS = {"Gemma3ForSequenceClassification": "Gemma3ForConditionalGeneration",
                           "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
                           "GPT2Model": "GPT2LMHeadModel", "GPT2ForSequenceClassification": "GPT2LMHeadModel"}


def causal_lm(name: str) -> str:
    """A family's base-model or sequence-classifier name (LlamaModel, Qwen3ForSequenceClassification)
    as the registered architecture with its transformer (its causal LM); any other name as it is."""
    if name in CLASSIFIER_TRANSFORMERS:
        return CLASSIFIER_TRANSFORMERS[name]
    for suffix in POOLING_SUFFIXES:
        causal = name.removesuffix(suffix) + "ForCausalLM"
        if name.endswith(suffix) and causal in ARCHITECTURES:
            return causal
    return name


def is_classifier(name: str) -> bool:
    """Whether `name` is a registered family's sequence classifier."""
    return name.endswith("ForSequenceClassification") and causal_lm(name) != name


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[causal_lm(name)]
    except KeyError:
        raise ValueError(f"unsupported architecture {name!r}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}") from None


def stored_transposed(cfg: ModelConfig, keys: tuple[str, ...], ndim: int) -> bool:
    """Whether the checkpoint holds the param at `keys` with its last two axes swapped: a
    projection's weight (not the LM head, a Linear) of a `conv1d` architecture, the stacked
    experts' weights (not their biases) of an `experts_transposed` one."""
    arch = architecture(cfg.architecture)
    if keys[-2:-1] == ("experts",):
        return arch.experts_transposed and ndim == 3
    return arch.conv1d and keys[-1] == "weight" and ndim == 2 and "lm_head" not in keys


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a HF config.json dict. The fields that every PretrainedConfig spells the
    same way are read here; the rest by the architecture's own parser."""
    name = (hf.get("architectures") or [hf.get("model_type", "unknown")])[0]
    eos = hf.get("eos_token_id")
    common = dict(
        architecture=name,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "float32"),
    )
    cfg = architecture(name).parse_config(hf, common)
    if cfg.hidden_act not in ACTIVATIONS:   # every family's, checked once
        raise ValueError(f"unsupported activation {cfg.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
    return cfg


def param_logical_axes(path: tuple[str, ...], cfg: ModelConfig) -> tuple[str, ...]:
    """Logical axes of the parameter at `path` (its keys), by its family's first matching suffix."""
    for suffix, axes in architecture(cfg.architecture).param_axes.items():
        if path[-len(suffix):] == suffix:
            return axes
    raise ValueError(f"no sharding rule for parameter {'/'.join(path)} of {cfg.architecture}")
