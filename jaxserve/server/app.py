"""Flask app factory: the OpenAI routes plus /health, /metrics, /tokenize, /detokenize, optional
Bearer-token auth, and JSON errors for everything."""
from __future__ import annotations

import hmac
import os

from flask import Flask, Response, current_app, jsonify, request

from jaxserve.config import EngineConfig
from jaxserve.server.errors import APIError, register_error_handlers
from jaxserve.server.host import EngineHost
from jaxserve.server.openai_api import bp as openai_bp, chat_prompt_ids
from jaxserve.server.validation import field, is_int, json_body, messages

TINY_MODEL_NAME = "jaxserve-tiny"
MAX_BODY_BYTES = 4 * 2**20
OPEN_ROUTES = ("/health", "/metrics")   # reachable without the API key (probes, scrapers)


def model_name(model_dir: str | None) -> str:
    return TINY_MODEL_NAME if model_dir is None else os.path.basename(os.path.normpath(model_dir))


def create_app(engine_cfg: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, on_load_error=None) -> Flask:
    """Starts loading the engine in a background thread; /health says 503 until it is warm."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.json.sort_keys = False
    app.extensions["jaxserve"] = EngineHost(engine_cfg, served_model_name or model_name(engine_cfg.model),
                                            on_load_error)
    register_error_handlers(app)
    app.register_blueprint(openai_bp)

    if api_key:
        @app.before_request
        def _authenticate():
            if request.path in OPEN_ROUTES:
                return
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")

    @app.get("/health")
    def health():
        _host().require_engine()
        return jsonify({"status": "ok"})

    @app.get("/metrics")
    def metrics():
        return Response(_host().metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/tokenize")
    def tokenize():
        body = json_body()
        engine = _host().require_engine().engine
        if "messages" in body:
            tokens = chat_prompt_ids(engine.tokenizer, messages(body))
        else:
            text = field(body, "prompt", lambda v: isinstance(v, str), "a string", None)
            if text is None:
                raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
            add_special = field(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
            tokens = engine.tokenizer.encode(text, add_special_tokens=add_special)
        return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    def detokenize():
        body = json_body()
        engine = _host().require_engine().engine
        vocab = engine.model_cfg.vocab_size
        tokens = field(body, "tokens", lambda v: isinstance(v, list) and all(is_int(t) and 0 <= t < vocab for t in v),
                       f"a list of token ids in [0, {vocab})", None)
        if tokens is None:
            raise APIError(400, "'tokens' is required", param="tokens")
        return jsonify({"prompt": engine.tokenizer.decode(tokens)})

    return app


def _host() -> EngineHost:
    return current_app.extensions["jaxserve"]
