"""Flask app factory: the OpenAI routes (embeddings among them), vLLM's classify, score and rerank,
plus /health, /metrics, /tokenize, /detokenize, /tokenizer_info, /version, vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter, sglang's /update_weights_from_disk, vLLM's
sleep mode (/sleep, /wake_up, /is_sleeping), optional Bearer-token auth (one key, or
per-tenant keys whose tenant salts the prefix cache of every request), and JSON errors for everything."""
from __future__ import annotations

import hmac
import os

import yaml
from flask import Flask, Response, current_app, g, jsonify, request

from jaxserve.config import EngineConfig
from jaxserve.server.embeddings_api import bp as embeddings_bp
from jaxserve.server.errors import APIError, register_error_handlers
from jaxserve.server.host import EngineHost, version
from jaxserve.server.openai_api import bp as openai_bp, chat_prompt
from jaxserve.server.responses_api import bp as responses_bp
from jaxserve.server.score_api import bp as score_bp
from jaxserve.server.validation import field, is_int, json_body

TINY_MODEL_NAME = "jaxserve-tiny"
MAX_BODY_BYTES = 4 * 2**20
OPEN_ROUTES = ("/health", "/metrics")   # reachable without the API key (probes, scrapers)


def model_name(model_dir: str | None) -> str:
    return TINY_MODEL_NAME if model_dir is None else os.path.basename(os.path.normpath(model_dir))


def read_api_keys(path: str) -> dict[str, str]:
    """An --api-keys-file: a YAML (or JSON) mapping of API key -> tenant name."""
    with open(path) as f:
        keys = yaml.safe_load(f)
    if not (isinstance(keys, dict) and keys and all(isinstance(k, str) and k and isinstance(t, str) and t
                                                    for k, t in keys.items())):
        raise ValueError(f"{path} must map API keys to tenant names (non-empty strings)")
    return keys


def create_app(engine_cfg: EngineConfig, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, on_load_error=None,
               api_keys: dict[str, str] | None = None, tool_call_parser: str | None = None,
               reasoning_parser: str | None = None, return_tokens_as_token_ids: bool = False) -> Flask:
    """Starts loading the engine in a background thread; /health says 503 until it is warm.
    `api_key` admits one key; `api_keys` (key -> tenant) several, each request's tenant (flask.g)
    then salting its prefix cache. `tool_call_parser` reads tool_choice "auto"'s calls
    (jaxserve/server/tool_parsers.py); None: "auto" is a 400. `reasoning_parser` sets chat
    answers' reasoning apart (jaxserve/server/reasoning.py). `return_tokens_as_token_ids`: the
    default of the request field of that name."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.config["TOOL_CALL_PARSER"] = tool_call_parser
    app.config["REASONING_PARSER"] = reasoning_parser
    app.config["RETURN_TOKENS_AS_TOKEN_IDS"] = return_tokens_as_token_ids
    app.json.sort_keys = False
    app.extensions["jaxserve"] = EngineHost(engine_cfg, served_model_name or model_name(engine_cfg.model),
                                            on_load_error)
    register_error_handlers(app)
    app.register_blueprint(openai_bp)
    app.register_blueprint(responses_bp)
    app.register_blueprint(embeddings_bp)
    app.register_blueprint(score_bp)

    # key -> tenant. A lone --api-key has none (no salt); beside tenants' keys it is tenant "", so
    # no request goes unsalted, whose client could then pick another tenant's salt itself.
    tenants = {**({api_key: "" if api_keys else None} if api_key else {}), **(api_keys or {})}
    if tenants:
        @app.before_request
        def _authenticate():
            if request.path in OPEN_ROUTES:
                return
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            # Every key compared, so the time taken does not tell which key a guess came close to.
            found = [t for key, t in tenants.items() if hmac.compare_digest(token.strip().encode(), key.encode())]
            if scheme.lower() != "bearer" or not found:
                raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
            g.tenant = found[0]

    @app.get("/health")
    def health():
        _host().require_engine()
        return jsonify({"status": "ok"})

    @app.get("/version")
    def version_route():
        return jsonify({"version": version()})

    @app.get("/metrics")
    def metrics():
        return Response(_host().metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/tokenize")
    def tokenize():
        body = json_body()
        engine = _host().require_engine().engine
        if "messages" in body:
            tokens = chat_prompt(engine.tokenizer, body)[1]
        else:
            text = field(body, "prompt", lambda v: isinstance(v, str), "a string", None)
            if text is None:
                raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
            add_special = field(body, "add_special_tokens", lambda v: isinstance(v, bool), "a boolean", True)
            tokens = engine.tokenizer.encode(text, add_special_tokens=add_special)
        return jsonify({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @app.get("/tokenizer_info")
    def tokenizer_info():
        """What a client needs to build prompts itself (as vLLM's route): the special tokens, the
        ids that end generation, the chat template."""
        engine = _host().require_engine().engine
        tok = engine.tokenizer
        return jsonify({**tok.special_tokens, "eos_token_ids": sorted(engine.eos_token_ids),
                        "chat_template": tok.chat_template, "max_model_len": engine.max_model_len})

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

    @app.post("/v1/load_lora_adapter")
    def load_lora_adapter():
        """vLLM's: {"lora_name", "lora_path"} served from now on, its name a `model`."""
        body = _lora_update()
        name, path = (field(body, key, lambda v: isinstance(v, str) and v, "a non-empty string", None)
                      for key in ("lora_name", "lora_path"))
        if name is None or path is None:
            raise APIError(400, "both 'lora_name' and 'lora_path' are required",
                           param="lora_path" if name else "lora_name")
        _host().load_lora(name, path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", mimetype="text/plain")

    @app.post("/v1/unload_lora_adapter")
    def unload_lora_adapter():
        """vLLM's: {"lora_name"} no longer served (requests already running on it finish)."""
        name = field(_lora_update(), "lora_name", lambda v: isinstance(v, str) and v, "a non-empty string", None)
        if name is None:
            raise APIError(400, "'lora_name' is required", param="lora_name")
        _host().unload_lora(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", mimetype="text/plain")

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk():
        """sglang's: {"model_path"}, a checkpoint of the served model whose weights serve from now on."""
        if not _host().engine_cfg.allow_weight_updates:
            raise APIError(404, "weight updates are off: start the server with --allow-weight-updates")
        path = field(json_body(), "model_path", lambda v: isinstance(v, str) and v, "a non-empty string", None)
        if path is None:
            raise APIError(400, "'model_path' is required", param="model_path")
        loaded = _host().update_weights(path)
        return jsonify({"success": True, "message": f"loaded {loaded} tensors from {path}", "num_tensors": loaded})

    @app.post("/sleep")
    def sleep():
        """vLLM's: ?level=1 (default: the weights to host memory) or 2 (dropped); the KV cache dropped."""
        level = _sleep_mode().args.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 or 2, got {level!r}", param="level")
        _host().sleep(int(level))
        return jsonify({"is_sleeping": True})

    @app.post("/wake_up")
    def wake_up():
        """vLLM's: ?tags=weights and/or ?tags=kv_cache (repeated), none: both."""
        _host().wake_up(_sleep_mode().args.getlist("tags") or None)
        return jsonify({"is_sleeping": _host().is_sleeping()})

    @app.get("/is_sleeping")
    def is_sleeping():
        _sleep_mode()
        return jsonify({"is_sleeping": _host().is_sleeping()})

    return app


def _sleep_mode():
    """The request of a sleep mode route; 404 unless sleep mode is on (vLLM has no such routes then)."""
    if not _host().engine_cfg.enable_sleep_mode:
        raise APIError(404, "sleep mode is off: start the server with --enable-sleep-mode")
    return request


def _lora_update() -> dict:
    """The body of a LoRA load or unload; 404 unless runtime updating is on (vLLM has no such routes then)."""
    if not _host().engine_cfg.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA adapter loading is off: start the server with --allow-runtime-lora-updating "
                            "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    return json_body()


def _host() -> EngineHost:
    return current_app.extensions["jaxserve"]
