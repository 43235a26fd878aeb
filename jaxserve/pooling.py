"""Embeddings (vLLM's pooling runner): each prompt's final hidden states pooled into one vector.

An engine whose `runner` is "pooling" serves embedding requests (a PoolingParams where a
SamplingParams would go, as in vLLM) and no generation; "auto" picks it for a sentence-transformers
model (a modules.json beside config.json: Qwen3-Embedding, gte-Qwen2, e5-mistral) or a base-model
architecture (MistralModel, Qwen2Model: no LM head), and "generate" otherwise. The model's pooling (`Pooler`) comes from those files: the Pooling module's
pooling_mode_lasttoken / _mean_tokens / _cls_token (LAST, MEAN, CLS) and whether a Normalize module
follows; without them LAST, normalized (vLLM's default for decoder models). A Matryoshka model
(config.json `is_matryoshka` or `matryoshka_dimensions`) may be asked for fewer `dimensions`.

A sequence classifier (XForSequenceClassification: `score`, a Linear [num_labels, hidden] without
bias, on the last token's final hidden state; config.json's id2label names the labels) runs on the
same runner, LAST pooling, unnormalized: the head is applied on the host to the one pooled vector
per sequence (a tiny matmul), and a "classify" request gets the label logits (the activation, softmax or
sigmoid, is the caller's: jaxserve/scoring.py). Runner auto picks pooling for it too. A causal LM
becomes one through vLLM's hf_overrides (EngineConfig.hf_overrides), as the Qwen3-Reranker is
served: `classifier_from_token` names tokens whose LM-head rows are the head, one label each; with
`method` "from_2_way_softmax" (or `is_original_qwen3_reranker`) two tokens make one label, the
second's row minus the first's (the sigmoid of logit("yes") - logit("no") is the softmax's "yes").

The hidden states are those the prefill steps compute anyway, as prompt logprobs' are: `pack` lists
the hidden rows of a step that each pooling sequence needs (LAST: its last prompt position, MEAN:
each position of the chunk, CLS: position 0) and the sequence's segment, `compute` sums them per
segment in f32 on the device (one compilation per token bucket, at warm-up), `accumulate` adds the
sums to the sequences. `Pooled.upto` (positions packed so far, advanced when packed) keeps a chunk
recomputed after a preemption from adding twice. When the prompt has run, `embedding` averages
(MEAN), keeps the first `dimensions` and normalizes. MEAN and CLS need every prompt position's
hidden state, so such a sequence skips the prefix-cache match, as prompt logprobs do (LAST's last
position is always computed).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.checkpoint import has_tensor, read_tensor
from jaxserve.config import EngineConfig, ModelConfig, read_hf_config
from jaxserve.models.registry import architecture, causal_lm, is_classifier
from jaxserve.sampling_params import InvalidRequest, PoolingParams, SamplingParams
from jaxserve.tokenizer import load_tokenizer

POOLING_TYPES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
ST_MODULES = "modules.json"   # sentence-transformers' list of modules after the transformer
ST_MODULE = "sentence_transformers.models."


@dataclasses.dataclass(frozen=True)
class Pooler:
    """A model's pooling: its type (LAST, MEAN, CLS), whether it normalizes, the Matryoshka
    dimensions it may be cut to (None: none; (): any) and a sequence classifier's score head (f32
    [num_labels, hidden]) and label names (None, (): an embedding model)."""
    type: str = "LAST"
    normalize: bool = True
    matryoshka: tuple[int, ...] | None = None
    classifier: np.ndarray | None = dataclasses.field(default=None, compare=False)
    labels: tuple[str, ...] = ()

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """Raises InvalidRequest for a task or dimensions the model cannot give."""
        if params.task == "embed" and self.classifier is not None:
            raise InvalidRequest("this model is a sequence classifier: it serves classify, score and rerank, "
                                 "not embeddings", param="model")
        if params.task == "classify" and self.classifier is None:
            raise InvalidRequest("this model serves embeddings: it has no classification head", param="model")
        d = params.dimensions
        if d is None:
            return
        if self.matryoshka is None:
            raise InvalidRequest("this model does not support Matryoshka representation: its output "
                                 "dimensions cannot be changed", param="dimensions")
        if not 1 <= d <= hidden_size or (self.matryoshka and d not in self.matryoshka):
            allowed = ", ".join(map(str, self.matryoshka)) if self.matryoshka else f"1 to {hidden_size}"
            raise InvalidRequest(f"dimensions must be one of {allowed}, got {d}", param="dimensions")


def configure(ecfg: EngineConfig, model_dir: str) -> tuple[EngineConfig, ModelConfig, Pooler | None]:
    """The engine config with its `runner` resolved (auto: pooling for a sentence-transformers
    directory or a base-model or sequence-classifier architecture, LlamaModel and the like), the
    model config (config.json, the engine's hf_overrides over it; its experts laid out as
    enable_expert_parallel asks), and the model's pooling (None:
    runner generate). A pooling checkpoint may lack the LM head (Qwen3-Embedding-8B, base models,
    classifiers): the head is then tied to the embeddings, for the logits of the one token a
    pooling request samples and drops."""
    hf = read_hf_config(model_dir, ecfg.hf_overrides)
    cfg = dataclasses.replace(ModelConfig.from_hf_dict(hf), expert_parallel=ecfg.enable_expert_parallel)
    kind = ecfg.runner
    if kind == "auto":
        no_lm_head = causal_lm(cfg.architecture) != cfg.architecture
        kind = "pooling" if no_lm_head or os.path.exists(os.path.join(model_dir, ST_MODULES)) else "generate"
    if kind == "generate" and is_classifier(cfg.architecture):
        raise ValueError(f"{model_dir} is a sequence classifier ({cfg.architecture}): serve it with runner pooling")
    if kind == "pooling" and not has_tensor(model_dir, "lm_head.weight"):
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return dataclasses.replace(ecfg, runner=kind), cfg, load_pooler(model_dir, hf, cfg) if kind == "pooling" else None


def load_pooler(model_dir: str, hf: dict, cfg: ModelConfig) -> Pooler:
    """The model's pooling, from its classifier head or its sentence-transformers files (see the
    module docstring); `hf` its config.json (with any overrides), `cfg` the model config."""
    if is_classifier(cfg.architecture):
        return classifier_pooler(model_dir, hf, cfg)
    matryoshka = hf.get("matryoshka_dimensions")
    matryoshka = tuple(matryoshka) if matryoshka else (() if hf.get("is_matryoshka") else None)
    path = os.path.join(model_dir, ST_MODULES)
    if not os.path.exists(path):
        return Pooler(matryoshka=matryoshka)
    with open(path) as f:
        modules = {m["type"].removeprefix(ST_MODULE): m.get("path", "") for m in json.load(f)}
    if unknown := set(modules) - {"Transformer", "Pooling", "Normalize"}:
        raise ValueError(f"{path}: sentence-transformers modules {sorted(unknown)} are not supported "
                         "(supported: Transformer, Pooling, Normalize)")
    kind = "LAST"
    if "Pooling" in modules:
        with open(os.path.join(model_dir, modules["Pooling"], "config.json")) as f:
            modes = [k for k, v in json.load(f).items() if k.startswith("pooling_mode_") and v]
        if len(modes) != 1 or modes[0] not in POOLING_TYPES:
            raise ValueError(f"{model_dir}: pooling modes {modes} are not supported (supported: one of "
                             f"{', '.join(POOLING_TYPES)})")
        kind = POOLING_TYPES[modes[0]]
    return Pooler(kind, "Normalize" in modules, matryoshka)


def classifier_pooler(model_dir: str, hf: dict, cfg: ModelConfig) -> Pooler:
    """A sequence classifier's pooling: LAST, unnormalized, its score head and labels (id2label),
    or the head of a causal LM's tokens (classifier_from_token)."""
    if "classifier_from_token" in hf:
        return token_classifier_pooler(model_dir, hf, cfg)
    score = read_tensor(model_dir, "score.weight")
    id2label = hf.get("id2label") or {str(i): f"LABEL_{i}" for i in range(len(score))}
    labels = tuple(id2label[str(i)] for i in range(len(id2label)))
    if len(labels) != len(score):
        raise ValueError(f"{model_dir}: config.json names {len(labels)} labels (id2label), its score head "
                         f"has {len(score)}")
    return Pooler("LAST", normalize=False, classifier=score, labels=labels)


def token_classifier_pooler(model_dir: str, hf: dict, cfg: ModelConfig) -> Pooler:
    """The head made of the LM head's rows of `classifier_from_token`'s tokens (see the module docstring)."""
    tokens, tokenizer = hf["classifier_from_token"], load_tokenizer(model_dir)
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in tokens]
    if not tokens or any(len(i) != 1 for i in ids):
        raise ValueError(f"{model_dir}: classifier_from_token {tokens} must be tokens of its tokenizer, one id each "
                         f"(they encode as {ids})")
    # the LM head the engine computes: the embeddings when tied (configure ties a missing head)
    path = ("model", "embed_tokens", "embedding") if cfg.tie_word_embeddings else ("lm_head", "weight")
    rows = read_tensor(model_dir, architecture(cfg.architecture).hf_tensor(path, cfg)[0], [i[0] for i in ids])
    if hf.get("method") == "from_2_way_softmax" or hf.get("is_original_qwen3_reranker"):
        if len(tokens) != 2:
            raise ValueError(f"{model_dir}: a 2-way softmax classifier takes two classifier_from_token, got {tokens}")
        return Pooler("LAST", normalize=False, classifier=rows[1:] - rows[:1], labels=(tokens[1],))
    return Pooler("LAST", normalize=False, classifier=rows, labels=tuple(tokens))


@dataclasses.dataclass
class Pooled:
    """One sequence's pooling while its prompt runs (Sequence.pooling)."""
    type: str
    params: PoolingParams
    normalize: bool
    classifier: np.ndarray | None = None   # Pooler.classifier's, for a "classify" request
    upto: int = 0                          # prompt positions packed so far
    total: np.ndarray | None = None        # f32 [hidden]: the sum of the pooled hidden states

    def positions(self, start: int, end: int, prompt_len: int) -> range:
        """The positions of [start, end) to pool that no earlier step packed."""
        first = max(start, self.upto)
        if self.type == "LAST":
            return range(prompt_len - 1, prompt_len) if first <= prompt_len - 1 < end else range(0)
        if self.type == "CLS":
            return range(0, 1) if first == 0 < end else range(0)
        return range(first, end)

    def result(self, prompt_len: int) -> list[float]:
        """The embedding, or a classifier's label logits."""
        v = self.total / (prompt_len if self.type == "MEAN" else 1)
        if self.classifier is not None:
            return (self.classifier @ v).tolist()
        v = v[:self.params.dimensions]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.tolist()


def served(pooler: Pooler | None, params: SamplingParams | PoolingParams,
           hidden_size: int) -> tuple[SamplingParams, Pooled | None]:
    """The sampling params an engine runs a request with and, for a pooling request (an engine
    with a pooler), its pooling: the prompt runs as a prefill whose one sampled token is dropped.
    Raises InvalidRequest for a request the engine does not serve."""
    if (pooler is not None) != isinstance(params, PoolingParams):
        raise InvalidRequest("this model serves embeddings or classes (runner pooling), not text generation"
                             if pooler else "this model does not serve embeddings, classes or scores: start it "
                             "with runner pooling", param="model")
    if pooler is None:
        return params, None
    pooler.check(params, hidden_size)
    pooled = Pooled(pooler.type, params, pooler.normalize if params.normalize is None else params.normalize,
                    pooler.classifier)
    return SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=params.truncate_prompt_tokens), pooled


def pack(rows, num_tokens: int, num_segments: int):
    """rows: (scheduled row, index of its first token in the step). Returns (seqs, (index,
    segments)) for the rows of pooling sequences with positions to pool, or None when none has:
    index [num_tokens] the hidden rows, segments which sequence each belongs to (padding:
    num_segments, dropped)."""
    seqs, index, segments = [], [], []
    for s, cursor in rows:
        pooled = s.seq.pooling
        if pooled is None:
            continue
        start = s.seq.num_computed_tokens
        positions = pooled.positions(start, start + s.num_query_tokens, s.seq.num_prompt_tokens)
        pooled.upto = max(pooled.upto, start + s.num_query_tokens)
        if not positions:
            continue
        index += [cursor + p - start for p in positions]
        segments += [len(seqs)] * len(positions)
        seqs.append(s.seq)
    if not seqs:
        return None
    pad = num_tokens - len(index)
    return seqs, (np.array(index + [0] * pad, np.int32), np.array(segments + [num_segments] * pad, np.int32))


@functools.partial(jax.jit, static_argnames=("num_segments",))
def compute(hidden, index, segments, *, num_segments: int):
    """f32 [num_segments, hidden]: the sum of the hidden rows `index` of each segment."""
    return jax.ops.segment_sum(hidden[index].astype(jnp.float32), segments, num_segments=num_segments)


def accumulate(seqs, sums: np.ndarray) -> None:
    """Add `compute`'s sums to the sequences, in `pack`'s order."""
    for seq, row in zip(seqs, np.asarray(sums)):
        pooled = seq.pooling
        pooled.total = row.copy() if pooled.total is None else pooled.total + row
