"""OpenAI's /v1/embeddings, served by an engine with runner pooling (jaxserve/pooling.py), as vLLM.

`input`: a string, strings, token ids or lists of token ids, up to OpenAI's 2,048 per request;
`encoding_format` "float" (the default) or "base64" (the little-endian float32 bytes, what the
openai client asks for); `dimensions` for a Matryoshka model. vLLM's extras: `truncate_prompt_tokens`,
`add_special_tokens` (default true: the tokenizer's bos/eos, which embedding models are trained
with), `normalize`, `timeout`, and `messages` instead of `input` (one conversation, as the chat
template renders it, without a generation prompt unless `add_generation_prompt`; /classify too). The pieces every pooling route shares (score_api.py's classify,
score and rerank too) are here: the engine and model, the pooling params, and `pool`, which runs
the prompts max_num_seqs at a time.
"""
from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from flask import Blueprint, current_app, jsonify, request

from jaxserve.sampling_params import InvalidRequest, PoolingParams
from jaxserve.server.errors import APIError
from jaxserve.server.openai_api import chat_prompt, check_model, client_connected, request_timeout
from jaxserve.server.validation import field, is_int, json_body, prompts

bp = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048   # OpenAI's (also the most texts a classify, score or rerank request may hold)


def pooling_engine(body: dict):
    """(host, model name, engine) of a pooling route's request: the served model (no LoRA adapter)."""
    host = current_app.extensions["jaxserve"]
    model = check_model(body, host)
    if model != host.model_name:
        raise APIError(400, f"pooling requests run on the served model {host.model_name!r}, not on a LoRA adapter",
                       param="model")
    return host, model, host.require_engine().engine


def inputs(body: dict, engine) -> list[list[int]]:
    """body["input"]: a string, strings, token ids or lists of token ids, the strings tokenized
    with `add_special_tokens` (default true: the tokenizer's bos/eos, which pooling models are trained with);
    or vLLM's body["messages"]: one conversation through the chat template (which writes any bos)."""
    if "messages" in body:
        if "input" in body:
            raise APIError(400, "give 'input' or 'messages', not both", param="messages")
        return [chat_prompt(engine.tokenizer, body, generation_prompt=False)[1]]
    special = field(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
    items = prompts(body, lambda text: engine.tokenizer.encode(text, add_special_tokens=special), "input", MAX_INPUTS)
    return [ids for _, ids in items]


def pooling_params(body: dict, task: str, **fields) -> PoolingParams:
    """The body's vLLM pooling extras (truncate_prompt_tokens) and `fields`, for `task`."""
    try:
        return PoolingParams(task=task, truncate_prompt_tokens=field(body, "truncate_prompt_tokens", is_int,
                                                                      "an integer"), **fields)
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None


def pool(host, ids: list[list[int]], params: PoolingParams, request_id: str, timeout: float | None,
         prompt_field: str) -> list:
    """Each prompt's final output (RequestOutput.pooled), in order. max_num_seqs prompts run at a
    time, so a long list never overflows the server's queue (whose bound is per request); a prompt
    the engine refuses is named as the body's `prompt_field`."""
    deadline = timeout and time.monotonic() + timeout
    outputs, window = [], host.require_engine().engine.ecfg.max_num_seqs
    for start in range(0, len(ids), window):
        try:
            streams = host.submit(ids[start:start + window], params, f"{request_id}-{start}")
        except APIError as e:
            e.param = prompt_field if e.param == "prompt" else e.param
            raise
        left = deadline and max(deadline - time.monotonic(), 1e-3)
        outputs += [out for _, out in host.follow(streams, alive=client_connected(request.environ), timeout=left)
                    if out.finished]
    return outputs


@bp.post("/v1/embeddings")
def embeddings():
    body = json_body()
    host, model, engine = pooling_engine(body)
    fmt = field(body, "encoding_format", lambda v: v in ("float", "base64"), '"float" or "base64"', "float")
    ids = inputs(body, engine)
    params = pooling_params(
        body, "embed", dimensions=field(body, "dimensions", lambda v: is_int(v) and v >= 1, "a positive integer"),
        normalize=field(body, "normalize", lambda v: isinstance(v, bool), "a boolean"))
    request_id = f"embd-{uuid.uuid4().hex}"
    outputs = pool(host, ids, params, request_id, request_timeout(body), "input")
    data = []
    for i, out in enumerate(outputs):
        vector = np.asarray(out.pooled, np.float32)
        data.append({"index": i, "object": "embedding",
                     "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                     if fmt == "base64" else vector.tolist()})
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return jsonify({"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
