"""jaxserve: a JAX/XLA engine that serves large language models.

The offline API, as vLLM users write it: `from jaxserve import LLM, SamplingParams` (and
`LoRARequest`, an adapter for LLM.generate; `PoolingParams` for LLM.embed and LLM.classify;
LLM.score too; `BeamSearchParams` for LLM.beam_search). Importing jaxserve starts no JAX: `LLM` builds its engine when called.
"""
from jaxserve.beam_search import BeamSearchParams
from jaxserve.config import EngineConfig
from jaxserve.llm import (LLM, ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput, Logprob,
                          RequestOutput, ScoringRequestOutput)
from jaxserve.sampling_params import LoRARequest, PoolingParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig", "LoRARequest",
           "PoolingParams", "BeamSearchParams", "EmbeddingRequestOutput", "ClassificationRequestOutput", "ScoringRequestOutput"]
