"""vLLM's classification, scoring and reranking routes, served by an engine with runner pooling
(jaxserve/pooling.py; the scores: jaxserve/scoring.py).

POST /classify: `input` and `add_special_tokens` (as /v1/embeddings'), a sequence classifier's labels ->
  data [{index, label, probs, num_classes}] (label: the likeliest, config.json's id2label).
POST /score, /v1/score: `text_1`, `text_2` (a string or strings; 1:1, 1:N or N:N) -> data
  [{index, object: "score", score}]: a cross-encoder's sigmoid, or an embedding model's cosine.
POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's): `query`, `documents` (strings),
  `top_n` (0, the default: all), `return_documents` (default true) -> results [{index,
  document: {text}, relevance_score}], best first, and usage {total_tokens}.
Each takes vLLM's `truncate_prompt_tokens` and `timeout`.
"""
from __future__ import annotations

import time
import uuid

from flask import Blueprint, jsonify

from jaxserve import scoring
from jaxserve.sampling_params import InvalidRequest
from jaxserve.server.embeddings_api import MAX_INPUTS, inputs, pool, pooling_engine, pooling_params
from jaxserve.server.errors import APIError
from jaxserve.server.openai_api import request_timeout
from jaxserve.server.validation import field, is_int, json_body, required

bp = Blueprint("score", __name__)


def _texts(body: dict, name: str) -> list[str]:
    """body[name]: a string or a non-empty list of strings, as a list."""
    value = required(body, name, lambda v: isinstance(v, str) or (
        isinstance(v, list) and 0 < len(v) <= MAX_INPUTS and all(isinstance(t, str) for t in v)),
        f"a string or a list of 1 to {MAX_INPUTS} strings")
    return [value] if isinstance(value, str) else value


def _scores(body: dict, text_1: list[str], text_2: list[str], prompt_field: str, request_id: str):
    """The scores of text_1 against text_2, the prompt tokens they ran, and the model's name."""
    host, model, engine = pooling_engine(body)
    try:
        run = scoring.score_run(engine.pooler, engine.tokenizer, text_1, text_2)
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None
    outputs = pool(host, run.prompts, pooling_params(body, run.task), request_id, request_timeout(body), prompt_field)
    return run.scores([out.pooled for out in outputs]), sum(len(out.prompt_token_ids) for out in outputs), model


@bp.post("/classify")
def classify():
    body = json_body()
    host, model, engine = pooling_engine(body)
    ids = inputs(body, engine)
    request_id = f"classify-{uuid.uuid4().hex}"
    outputs = pool(host, ids, pooling_params(body, "classify"), request_id, request_timeout(body), "input")
    data = []
    for i, out in enumerate(outputs):
        label, probs = scoring.classification(out.pooled, engine.pooler.labels)
        data.append({"index": i, "label": label, "probs": probs, "num_classes": len(probs)})
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return jsonify({"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


@bp.post("/score")
@bp.post("/v1/score")
def score():
    body = json_body()
    request_id = f"score-{uuid.uuid4().hex}"
    # a prompt too long is named as text_2: a pair's or an embedded text's, usually the longer side
    scores, prompt_tokens, model = _scores(body, _texts(body, "text_1"), _texts(body, "text_2"), "text_2", request_id)
    return jsonify({"id": request_id, "object": "list", "created": int(time.time()), "model": model,
                    "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})


@bp.post("/rerank")
@bp.post("/v1/rerank")
@bp.post("/v2/rerank")
def rerank():
    body = json_body()
    query = required(body, "query", lambda v: isinstance(v, str), "a string")
    documents = required(body, "documents", lambda v: isinstance(v, list) and 0 < len(v) <= MAX_INPUTS and all(
        isinstance(d, str) for d in v), f"a list of 1 to {MAX_INPUTS} strings")
    top_n = field(body, "top_n", lambda v: is_int(v) and v >= 0, "a non-negative integer (0: all)", 0)
    with_documents = field(body, "return_documents", lambda v: isinstance(v, bool), "a boolean", True)
    request_id = f"rerank-{uuid.uuid4().hex}"
    scores, prompt_tokens, model = _scores(body, [query], documents, "documents", request_id)
    best = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n or None]
    results = [{"index": i, **({"document": {"text": documents[i]}} if with_documents else {}),
                "relevance_score": scores[i]} for i in best]
    return jsonify({"id": request_id, "model": model, "usage": {"total_tokens": prompt_tokens}, "results": results})
