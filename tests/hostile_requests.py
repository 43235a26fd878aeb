"""Hostile HTTP requests for a served bytes model (tests/server_harness.py's, under the embedded
model's name): each should be answered with its 4xx status and an OpenAI error body, and the server
should stay up (tests/test_server.py sends them)."""
import json

import requests

from tests.server_harness import BYTES_MAX_LEN

NAME = "jaxserve-tiny"   # the embedded model's name, so the README examples run as written
MAX_LEN = BYTES_MAX_LEN
LONG = "x" * (MAX_LEN + 20)
C, CHAT = "/v1/completions", "/v1/chat/completions"
OK = {"model": NAME, "prompt": "hi", "max_tokens": 2}
MSG = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}
HOSTILE = [  # (id, method, path, body: dict or raw bytes, extra headers, expected status)
    ("malformed-json", "POST", C, b'{"prompt": "a",', JSON, 400),
    ("empty-body", "POST", C, b"", JSON, 400),
    ("array-body", "POST", C, b"[1, 2]", JSON, 400),
    ("non-utf8", "POST", C, b'{"prompt": "\xff\xfe"}', JSON, 400),
    ("lone-surrogate", "POST", C, b'{"prompt": "\\ud800"}', JSON, 400),
    ("deep-nesting", "POST", C, b"[" * 100000 + b"]" * 100000, JSON, 400),
    ("giant-integer", "POST", C, b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", JSON, 400),
    ("wrong-content-type", "POST", C, json.dumps(OK).encode(), {"Content-Type": "text/plain"}, 415),
    ("huge-body", "POST", C, b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}', JSON, 413),
    ("unknown-route", "POST", "/v1/nothing", OK, {}, 404),
    ("wrong-method", "GET", C, None, {}, 405),
    ("unknown-model", "POST", C, {**OK, "model": "gpt-17"}, {}, 404),
    ("model-not-string", "POST", C, {**OK, "model": 5}, {}, 400),
    ("no-prompt", "POST", C, {"model": NAME}, {}, 400),
    ("prompt-number", "POST", C, {**OK, "prompt": 5}, {}, 400),
    ("prompt-empty-list", "POST", C, {**OK, "prompt": []}, {}, 400),
    ("prompt-mixed-list", "POST", C, {**OK, "prompt": ["a", 1]}, {}, 400),
    ("prompt-empty-string", "POST", C, {**OK, "prompt": ""}, {}, 400),
    ("token-id-too-big", "POST", C, {**OK, "prompt": [1, 10**6]}, {}, 400),
    ("token-id-negative", "POST", C, {**OK, "prompt": [-1]}, {}, 400),
    ("prompt-too-long", "POST", C, {**OK, "prompt": LONG}, {}, 400),
    ("max-tokens-string", "POST", C, {**OK, "max_tokens": "2"}, {}, 400),
    ("max-tokens-bool", "POST", C, {**OK, "max_tokens": True}, {}, 400),
    ("max-tokens-zero", "POST", C, {**OK, "max_tokens": 0}, {}, 400),
    ("max-tokens-negative", "POST", C, {**OK, "max_tokens": -5}, {}, 400),
    ("max-tokens-huge", "POST", C, {**OK, "max_tokens": 10**12}, {}, 400),
    ("temperature-negative", "POST", C, {**OK, "temperature": -1}, {}, 400),
    ("temperature-inf", "POST", C, b'{"prompt": "a", "temperature": 1e999}', JSON, 400),
    ("temperature-nan", "POST", C, b'{"prompt": "a", "temperature": NaN}', JSON, 400),
    ("top-p-zero", "POST", C, {**OK, "top_p": 0}, {}, 400),
    ("top-k-float", "POST", C, {**OK, "top_k": 1.5}, {}, 400),
    ("top-k-huge", "POST", C, {**OK, "top_k": 10**20}, {}, 400),
    ("stop-token-ids-out-of-vocab", "POST", C, {**OK, "stop_token_ids": [10**20], "min_tokens": 1}, {}, 400),
    ("stop-token-ids-negative", "POST", C, {**OK, "stop_token_ids": [-1]}, {}, 400),
    ("presence-penalty-big", "POST", C, {**OK, "presence_penalty": 5}, {}, 400),
    ("repetition-penalty-zero", "POST", C, {**OK, "repetition_penalty": 0}, {}, 400),
    ("n-too-big", "POST", C, {**OK, "n": 1000}, {}, 400),
    ("n-zero", "POST", C, {**OK, "n": 0}, {}, 400),
    ("logprobs-too-many", "POST", C, {**OK, "logprobs": 50}, {}, 400),
    ("stop-not-strings", "POST", C, {**OK, "stop": [1, 2]}, {}, 400),
    ("stop-empty-string", "POST", C, {**OK, "stop": [""]}, {}, 400),
    ("stop-too-many", "POST", C, {**OK, "stop": [f"s{i}" for i in range(100)]}, {}, 400),
    ("seed-string", "POST", C, {**OK, "seed": "abc"}, {}, 400),
    ("seed-huge", "POST", C, {**OK, "seed": 2**70}, {}, 400),
    ("stream-not-bool", "POST", C, {**OK, "stream": "yes"}, {}, 400),
    ("tokens-as-ids-not-bool", "POST", C, {**OK, "return_tokens_as_token_ids": 1}, {}, 400),
    ("stream-options-without-stream", "POST", C, {**OK, "stream_options": {"include_usage": True}}, {}, 400),
    ("max-tokens-zero-without-echo-logprobs", "POST", C, {**OK, "max_tokens": 0, "echo": True}, {}, 400),
    ("prompt-logprobs-too-many", "POST", C, {**OK, "prompt_logprobs": 21}, {}, 400),
    ("prompt-logprobs-chat-too-many", "POST", CHAT, {**MSG, "prompt_logprobs": 21}, {}, 400),
    ("best-of", "POST", C, {**OK, "best_of": 3}, {}, 400),
    ("logit-bias-wrong-type", "POST", C, {**OK, "logit_bias": "x"}, {}, 400),
    ("logit-bias-too-big", "POST", C, {**OK, "logit_bias": {"1": 101}}, {}, 400),
    ("logit-bias-key-not-id", "POST", C, {**OK, "logit_bias": {"x": 1}}, {}, 400),
    ("logit-bias-id-past-vocab", "POST", C, {**OK, "logit_bias": {"258": 1}}, {}, 400),
    ("min-tokens-past-max-tokens", "POST", C, {**OK, "min_tokens": 3}, {}, 400),
    ("truncate-prompt-tokens-zero", "POST", C, {**OK, "truncate_prompt_tokens": 0}, {}, 400),
    ("truncate-prompt-tokens-minus-two", "POST", C, {**OK, "truncate_prompt_tokens": -2}, {}, 400),
    ("cache-salt-empty", "POST", C, {**OK, "cache_salt": ""}, {}, 400),
    ("chat-no-messages", "POST", CHAT, {"model": NAME}, {}, 400),
    ("chat-empty-messages", "POST", CHAT, {**MSG, "messages": []}, {}, 400),
    ("chat-message-not-object", "POST", CHAT, {**MSG, "messages": ["hi"]}, {}, 400),
    ("chat-wrong-role", "POST", CHAT, {**MSG, "messages": [{"role": "wizard", "content": "hi"}]}, {}, 400),
    ("chat-content-number", "POST", CHAT, {**MSG, "messages": [{"role": "user", "content": 5}]}, {}, 400),
    ("chat-image-part", "POST", CHAT, {**MSG, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, {}, 400),
    ("chat-top-logprobs-alone", "POST", CHAT, {**MSG, "top_logprobs": 2}, {}, 400),
    ("chat-top-logprobs-too-many", "POST", CHAT, {**MSG, "logprobs": True, "top_logprobs": 21}, {}, 400),
    ("chat-tools", "POST", CHAT, {**MSG, "tools": [{"type": "function"}]}, {}, 400),
    ("chat-continue-and-generation-prompt", "POST", CHAT, {**MSG, "continue_final_message": True}, {}, 400),
    ("chat-template-kwargs-list", "POST", CHAT, {**MSG, "chat_template_kwargs": ["note"]}, {}, 400),
    ("chat-reasoning-effort-unknown", "POST", CHAT, {**MSG, "reasoning_effort": "max"}, {}, 400),
    ("chat-reasoning-effort-twice", "POST", CHAT, {**MSG, "reasoning_effort": "low",
                                                   "chat_template_kwargs": {"reasoning_effort": "high"}}, {}, 400),
    ("chat-tool-calls-not-list", "POST", CHAT, {**MSG, "messages": [
        {"role": "assistant", "content": None, "tool_calls": {"name": "add"}}]}, {}, 400),
    ("chat-tool-call-arguments-not-json", "POST", CHAT, {**MSG, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}]}, {}, 400),
    ("chat-assistant-no-content-no-calls", "POST", CHAT, {**MSG, "messages": [
        {"role": "assistant", "content": None}]}, {}, 400),
    ("chat-too-long", "POST", CHAT, {**MSG, "messages": [{"role": "user", "content": LONG}]}, {}, 400),
    ("tokenize-no-prompt", "POST", "/tokenize", {"text": "hi"}, {}, 400),
    ("detokenize-bad-ids", "POST", "/detokenize", {"tokens": ["a", 10**9]}, {}, 400),
    # a generate engine serves no pooling routes (tests/test_scoring.py: a pooling one)
    ("embeddings-on-generate", "POST", "/v1/embeddings", {"input": "hi"}, {}, 400),
    ("classify-on-generate", "POST", "/classify", {"input": "hi"}, {}, 400),
    ("score-on-generate", "POST", "/v1/score", {"text_1": "a", "text_2": "b"}, {}, 400),
    ("rerank-on-generate", "POST", "/rerank", {"query": "a", "documents": ["b"]}, {}, 400),
]


def send(url: str, method: str, path: str, body, headers: dict) -> requests.Response:
    """A HOSTILE entry's request to the server at `url`: raw bytes as they are, a dict as JSON."""
    kw = {"data": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
    return requests.request(method, url + path, headers=headers, timeout=120, **kw)
