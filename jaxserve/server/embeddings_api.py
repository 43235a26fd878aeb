"""OpenAI's /v1/embeddings, served by an engine with runner pooling (jaxserve/pooling.py), as vLLM.

`input`: a string, strings, token ids or lists of token ids, up to OpenAI's 2,048 per request;
`encoding_format` "float" (the default) or "base64" (the little-endian float32 bytes, what the
openai client asks for); `dimensions` for a Matryoshka model. vLLM's extras: `truncate_prompt_tokens`,
`add_special_tokens` (default true: the tokenizer's bos/eos, which embedding models are trained
with), `normalize`, `timeout`. A long list runs max_num_seqs inputs at a time, so it never
overflows the server's queue (whose bound is per request).
"""
from __future__ import annotations

import base64
import time
import uuid

import numpy as np
from flask import Blueprint, current_app, jsonify, request

from jaxserve.sampling_params import InvalidRequest, PoolingParams
from jaxserve.server.errors import APIError
from jaxserve.server.openai_api import check_model, client_connected, request_timeout
from jaxserve.server.validation import field, is_int, json_body, prompts

bp = Blueprint("embeddings", __name__)
MAX_INPUTS = 2048   # OpenAI's


@bp.post("/v1/embeddings")
def embeddings():
    host = current_app.extensions["jaxserve"]
    body = json_body()
    model = check_model(body, host)
    if model != host.model_name:
        raise APIError(400, f"embeddings run on the served model {host.model_name!r}, not on a LoRA adapter",
                       param="model")
    engine = host.require_engine().engine
    fmt = field(body, "encoding_format", lambda v: v in ("float", "base64"), '"float" or "base64"', "float")
    special = field(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
    items = prompts(body, lambda text: engine.tokenizer.encode(text, add_special_tokens=special), "input", MAX_INPUTS)
    try:
        params = PoolingParams(
            dimensions=field(body, "dimensions", lambda v: is_int(v) and v >= 1, "a positive integer"),
            normalize=field(body, "normalize", lambda v: isinstance(v, bool), "a boolean"),
            truncate_prompt_tokens=field(body, "truncate_prompt_tokens", is_int, "an integer"))
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param) from None
    timeout = request_timeout(body)
    deadline = timeout and time.monotonic() + timeout
    request_id = f"embd-{uuid.uuid4().hex}"
    data, prompt_tokens, window = [], 0, engine.ecfg.max_num_seqs
    for start in range(0, len(items), window):
        ids = [i for _, i in items[start:start + window]]
        try:
            streams = host.submit(ids, params, f"{request_id}-{start}")
        except APIError as e:   # the engine names the prompt what this API calls `input`
            e.param = "input" if e.param == "prompt" else e.param
            raise
        left = deadline and max(deadline - time.monotonic(), 1e-3)
        for i, out in host.follow(streams, alive=client_connected(request.environ), timeout=left):
            if out.finished:
                vector = np.asarray(out.embedding, np.float32)
                data.append({"index": start + i, "object": "embedding",
                             "embedding": base64.b64encode(vector.astype("<f4").tobytes()).decode()
                             if fmt == "base64" else vector.tolist()})
                prompt_tokens += len(out.prompt_token_ids)
    return jsonify({"id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
                    "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})
