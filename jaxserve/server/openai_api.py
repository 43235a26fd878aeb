"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models (/v1/embeddings:
embeddings_api.py).

A request with several prompts (completions) or n > 1 becomes one engine request per prompt with
n choices each; choice index = prompt index * n + choice. Streaming follows OpenAI: one chunk per
choice per engine step that produced text, the finish_reason on each choice's last chunk, with
`stream_options.include_usage` a final chunk with empty `choices` and the usage, then [DONE]
(with `continuous_usage_stats`, every chunk carries the usage so far). The usage's
`prompt_tokens_details.cached_tokens` counts the prompt tokens found in the prefix cache.
`timeout` (seconds, a vLLM-style extra) bounds a request's time in the server: past it the
request ends with a 408 error (an error event in a stream) and its pages are freed.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Callable, NamedTuple

import jinja2
from flask import Blueprint, current_app, g, jsonify, request

from jaxserve.beam_search import round_params
from jaxserve.llm import logprob_dict
from jaxserve.sampling_params import InvalidRequest, sampling_defaults
from jaxserve.server.asgi import client_gone
from jaxserve.server.beam_streams import BeamSearchRequest
from jaxserve.server.errors import APIError
from jaxserve.server.reasoning import reasoning_reader
from jaxserve.server.sse import sse_response
from jaxserve.server.tools import tool_calls
from jaxserve.server.validation import (beam_search, chat_template_options, field, is_number, json_body, messages,
                                        prompts, sampling_params, stream_flags)
from jaxserve.tokenizer import IncrementalDetokenizer

bp = Blueprint("openai", __name__)
MIN_LOGPROB = -9999.0   # what OpenAI reports for -inf (JSON has no infinity)


def _host():
    return current_app.extensions["jaxserve"]


def check_model(body: dict, host) -> str:
    """The model the body names (default: the served model): the served model, or one of its LoRA
    adapters (lora_modules and those loaded since, as vLLM's), whose name selects it; else 404."""
    model = field(body, "model", lambda v: isinstance(v, str), "a string", host.model_name)
    served = [host.model_name, *host.lora_modules]
    if model not in served:
        raise APIError(404, f"model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
                       param="model", code="model_not_found")
    return model


def _lora_name(model: str, host) -> str | None:
    return None if model == host.model_name else model


def _model_card(host, model: str) -> dict:
    """vLLM's card: a LoRA adapter's `root` is its directory, its `parent` the served model."""
    adapter = _lora_name(model, host)   # (.get below: it may have been unloaded meanwhile)
    return {"id": model, "object": "model", "created": host.created, "owned_by": "jaxserve",
            "root": host.lora_modules.get(adapter) if adapter else host.engine_cfg.model or model,
            "parent": adapter and host.model_name}


@bp.get("/v1/models")
def list_models():
    host = _host()
    return jsonify({"object": "list", "data": [_model_card(host, m) for m in [host.model_name, *host.lora_modules]]})


@bp.get("/v1/models/<path:model>")
def retrieve_model(model: str):
    host = _host()
    return jsonify(_model_card(host, check_model({"model": model}, host)))


@bp.post("/v1/completions")
def completions():
    host = _host()
    body = json_body()
    model = check_model(body, host)
    engine = host.require_engine().engine
    params = sampling_params(body, chat=False, max_tokens=16, tenant=g.get("tenant"), defaults=_defaults(engine),
                             lora_name=_lora_name(model, host))
    stream, *usage_flags = stream_flags(body)
    echo = field(body, "echo", lambda v: isinstance(v, bool), "a boolean", False)
    items = prompts(body, engine.tokenizer.encode)
    ids = [i for _, i in items]
    echoes = [t if t is not None else engine.tokenizer.decode(i) for t, i in items] if echo else None
    timeout = request_timeout(body)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = submit(host, ids, params, request_id, beam_search(body, params))
    choices = _Choices(engine.tokenizer, params.n, chat=False, echoes=echoes, **_id_options(body))
    submitted = Submitted(body, model, request_id, streams, choices,
                          sum(len(params.resolve(i, engine.max_model_len)[0]) for i in ids), timeout)
    return _respond(host, submitted, "text_completion", stream, usage_flags)


@bp.post("/v1/chat/completions")
def chat_completions():
    host = _host()
    chat = submit_chat(host, json_body())
    stream, *usage_flags = stream_flags(chat.body)
    return _respond(host, chat, "chat.completion.chunk" if stream else "chat.completion", stream, usage_flags)


class Submitted(NamedTuple):
    """Requests in the engine, and what their answer is made from (completions, chat, responses)."""
    body: dict
    model: str   # as the body named it
    request_id: str
    streams: list
    choices: "_Choices"   # defined below
    prompt_tokens: int
    timeout: float | None


def submit_chat(host, body: dict, request_id: str | None = None) -> Submitted:
    """Checks a chat request's body (400 naming the field) and submits it to the engine."""
    model = check_model(body, host)
    engine = host.require_engine().engine
    tools = tool_calls(body, current_app.config["TOOL_CALL_PARSER"])   # checked before the template sees them
    text, ids = chat_prompt(engine.tokenizer, body)
    prefill = tools.prefill(text) if tools is not None else ""
    if prefill:   # harmony: a forced call begun for the model, its grammar from the first token (server/tools.py)
        text += prefill
        ids = engine.tokenizer.encode(text, add_special_tokens=False)
    reasoning = reasoning_reader(current_app.config["REASONING_PARSER"], text)
    # No max_tokens: up to the context length, after any truncation (SamplingParams.resolve).
    params = sampling_params(body, chat=True, max_tokens=None, tenant=g.get("tenant"),
                             tool_call=tools and tools.constraint, defaults=_defaults(engine),
                             grammar_after=reasoning.grammar_after if reasoning is not None and not prefill else "",
                             keep_special_tokens=any(r is not None and r.keeps_special_tokens
                                                     for r in (tools and tools.parser, reasoning)),
                             lora_name=_lora_name(model, host))
    timeout = request_timeout(body)
    request_id = request_id or f"chatcmpl-{uuid.uuid4().hex}"
    streams = submit(host, [ids], params, request_id, beam_search(body, params))
    choices = _Choices(engine.tokenizer, params.n, chat=True, tools=tools, token_bytes=engine.grammars.token_bytes,
                       reasoning=reasoning, **_id_options(body))
    return Submitted(body, model, request_id, streams, choices,
                     len(params.resolve(ids, engine.max_model_len)[0]), timeout)


def submit(host, prompts: list[list[int]], params, request_id: str, beam) -> list:
    """The prompts' engine requests (EngineHost.submit), or with `beam` their beam search
    (jaxserve/server/beam_streams.py), each prompt (cut to truncate_prompt_tokens) checked now as
    the engine checks a round's requests: a 400 before the response starts."""
    if beam is None:
        return host.submit(prompts, params, request_id)
    engine = host.require_engine().engine
    prompts = [params.resolve(ids, engine.max_model_len)[0] for ids in prompts]
    for ids in prompts:
        try:
            engine.new_request(ids, round_params(params, 1))
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
    return BeamSearchRequest(host, prompts, params, beam, request_id).streams


def _id_options(body: dict) -> dict:
    """vLLM's return_token_ids (each choice's or chunk's token ids; the prompt's in completions' choices,
    chat's response or first chunk) and return_tokens_as_token_ids (default: serve's flag of that name)."""
    as_ids = current_app.config["RETURN_TOKENS_AS_TOKEN_IDS"]
    return {k: field(body, name, lambda v: isinstance(v, bool), "a boolean", default) for k, name, default in
            (("return_ids", "return_token_ids", False), ("tokens_as_ids", "return_tokens_as_token_ids", as_ids))}


def request_timeout(body: dict) -> float | None:
    return field(body, "timeout", lambda v: is_number(v) and v > 0, "a positive number of seconds", None)


def _respond(host, submitted: Submitted, obj: str, stream: bool, usage_flags: list[bool]):
    """The SSE stream, or the JSON body, of submitted requests. `usage_flags`: stream_options'
    include_usage and continuous_usage_stats."""
    head = {"id": submitted.request_id, "object": obj, "created": int(time.time()), "model": submitted.model,
            "system_fingerprint": host.system_fingerprint}
    deltas = follow(host, submitted)
    if stream:
        return sse_response(chunks(deltas, submitted.choices, head, *usage_flags, submitted.prompt_tokens))
    return jsonify({**head, **collect(deltas, submitted.choices, submitted.prompt_tokens)})


def follow(host, submitted: Submitted):
    """The submitted requests' outputs as they come, ended early by the client leaving or the timeout."""
    return host.follow(submitted.streams, alive=client_connected(request.environ), timeout=submitted.timeout)


def _defaults(engine) -> dict:
    return sampling_defaults(engine.model_dir, engine.ecfg.generation_config)


def chat_prompt(tokenizer, body: dict, generation_prompt: bool = True) -> tuple[str, list[int]]:
    """The text and token ids of a chat request's messages, rendered by the model's chat template
    (`generation_prompt`: add_generation_prompt's default)."""
    msgs, options = messages(body), chat_template_options(body, generation_prompt)
    try:
        text = tokenizer.apply_chat_template(msgs, **options)
    except (ValueError, TypeError, jinja2.TemplateError) as e:   # the template's checks, or its input's types
        raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    return text, tokenizer.encode(text, add_special_tokens=False)   # the template wrote any bos itself


class _Choices:
    """Turns CompletionOutput deltas into OpenAI choice objects (completion or chat format)."""

    def __init__(self, tokenizer, n: int, chat: bool, echoes: list[str] | None = None, tools=None,
                 token_bytes: Callable[[int], bytes] | None = None, reasoning=None, return_ids: bool = False,
                 tokens_as_ids: bool = False):
        self.tokenizer, self.n, self.chat, self.echoes = tokenizer, n, chat, echoes
        self.return_ids, self.tokens_as_ids = return_ids, tokens_as_ids
        self.token_bytes = token_bytes   # a chat request's: each logprobs entry's `bytes`
        self.tools = tools   # a chat request's tool calls to read (jaxserve/server/tools.py), or None
        self.reasoning = reasoning   # a chat request's reasoning to set apart (server/reasoning.py), or None
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}    # completion logprobs' text_offset so far, per choice
        self.prompts: dict[int, tuple] = {}  # prompt index -> (prompt ids, prompt logprobs), once scored
        self.prompt_ids: dict[int, list[int]] = {}   # prompt index -> the prompt the engine runs

    def delta(self, prompt_index: int, c) -> dict | None:
        """The streamed choice for one delta, or None when it carries nothing."""
        index = prompt_index * self.n + c.index
        first = index not in self.started
        self.started.add(index)
        text, start = c.text, self.offsets.get(index, 0)
        results = c.logprobs if c.logprobs is not None and c.token_ids else None
        scored = self.prompts.get(prompt_index) if first else None
        returned = {"token_ids": list(c.token_ids)} if self.return_ids else {}
        if not (text or results or c.finish_reason or (first and self.chat) or scored or c.token_ids and returned):
            return None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return {"index": index, "delta": delta, "logprobs": self._chat_logprobs(results),
                    "finish_reason": c.finish_reason, **returned}
        if first and self.return_ids:
            returned["prompt_token_ids"] = self.prompt_ids[prompt_index]
        parts = []   # legacy logprobs: with echo, the prompt's tokens first (the first has none)
        if first and self.echoes is not None:
            if scored is not None:
                ids, plps = scored
                parts.append(self._completion_logprobs([(ids[0], None, None)] + [r[:3] for r in plps],
                                                       self._prompt_offsets(ids)))
            start = len(self.echoes[prompt_index])
            text = self.echoes[prompt_index] + text
        if results is not None:
            parts.append(self._completion_logprobs([r[:3] for r in results], start=start))
        self.offsets[index] = start + len(c.text)
        logprobs = {k: sum((p[k] for p in parts), []) for k in parts[0]} if parts else None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason, **returned}
        if scored is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(prompt_index)
        return choice

    def prompt_logprobs(self, prompt_index: int) -> list | None:
        """vLLM's prompt_logprobs of a prompt, once scored: None for its first token, then per token
        {"token id": {logprob, rank, decoded_token}} for the token and the top N."""
        if prompt_index not in self.prompts:
            return None
        decode = self.tokenizer.decode
        return [None] + [{str(t): dataclasses.asdict(lp) for t, lp in logprob_dict(r, decode).items()}
                         for r in self.prompts[prompt_index][1]]

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _token(self, token_id: int) -> str:   # how logprobs name a token
        return f"token_id:{token_id}" if self.tokens_as_ids else self._text(token_id)

    def _chat_logprobs(self, results) -> dict | None:
        if results is None:
            return None

        def entry(token_id, logprob):
            return {"token": self._token(token_id), "logprob": max(logprob, MIN_LOGPROB),
                    "bytes": list(self.token_bytes(token_id))}
        return {"content": [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                            for r in results]}

    def _prompt_offsets(self, ids: list[int]) -> list[int]:
        """Each prompt token's text_offset: the length of the text its predecessors decode to (as
        the echo shows it: special tokens add none; a token inside a character gets its start)."""
        detok, offsets, n = IncrementalDetokenizer(self.tokenizer, []), [], 0
        for token in ids:
            offsets.append(n)
            n += len(IncrementalDetokenizer.step_all([detok], [[token]])[0])
        return offsets

    def _completion_logprobs(self, entries: list[tuple], offsets: list[int] | None = None, start: int = 0) -> dict:
        """The legacy format for (token id, logprob, top) entries: their text_offset `offsets`, or
        else each token's text after its predecessors' from character `start` (a generated delta's
        tokens); logprob and top are None for a prompt's first token."""
        texts = [self._text(token) for token, _, _ in entries]
        tokens = [self._token(token) for token, _, _ in entries] if self.tokens_as_ids else texts
        tops = []
        for _, _, pairs in entries:
            top = None if pairs is None else {}
            for t, lp in pairs or ():   # most likely first; tokens that decode alike keep the best
                top.setdefault(self._token(t), max(lp, MIN_LOGPROB))
            tops.append(top)
        if offsets is None:
            offsets = list(itertools.accumulate([start] + [len(t) for t in texts[:-1]]))
        return {"tokens": tokens, "token_logprobs": [None if lp is None else max(lp, MIN_LOGPROB) for _, lp, _ in entries],
                "top_logprobs": tops, "text_offset": offsets}


def client_connected(environ) -> Callable[[], bool]:
    """Whether the request's client still holds its connection: the HTTP server says when it
    leaves (a streaming client that leaves would otherwise only be found when its stream ends)."""
    gone = client_gone(environ)
    return (lambda: True) if gone is None else (lambda: not gone.is_set())


class _ChoiceDeltas:
    """Iterates the choice deltas of a request's outputs, keeping each prompt's completion and
    cached token counts so far. The end of the iteration, early or not, closes `deltas`, which
    aborts whatever has not finished (a client that left)."""

    def __init__(self, deltas, choices: _Choices, prompt_tokens: int):
        self.deltas, self.choices, self.prompt_tokens = deltas, choices, prompt_tokens
        self.generated: dict[int, int] = {}
        self.cached: dict[int, int] = {}

    def usage(self) -> dict:
        completion = sum(self.generated.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}

    def __iter__(self):
        try:
            for prompt_index, out in self.deltas:
                self.generated[prompt_index] = out.num_generated_tokens
                self.cached[prompt_index] = out.num_cached_tokens
                self.choices.prompt_ids[prompt_index] = out.prompt_token_ids
                if out.prompt_logprobs is not None:
                    self.choices.prompts[prompt_index] = (out.prompt_token_ids, out.prompt_logprobs)
                for c in out.outputs:
                    d = self.choices.delta(prompt_index, c)
                    if d is not None:
                        yield d
        finally:
            self.deltas.close()


def chunks(deltas, choices: _Choices, head: dict, include_usage: bool, continuous_usage: bool,
            prompt_tokens: int):
    followed = _ChoiceDeltas(deltas, choices, prompt_tokens)
    stream = followed if choices.reasoning is None else choices.reasoning.stream(followed)
    for k, choice in enumerate(stream if choices.tools is None else choices.tools.stream(stream)):
        prompt = {"prompt_token_ids": choices.prompt_ids[0]} if k == 0 and choices.chat and choices.return_ids else {}
        yield {**head, **prompt, "choices": [choice], **({"usage": followed.usage()} if continuous_usage else {})}
    if include_usage:
        yield {**head, "choices": [], "usage": followed.usage()}


def collect(deltas, choices: _Choices, prompt_tokens: int) -> dict:
    """The non-streaming body: every choice's deltas merged."""
    merged: dict[int, dict] = {}
    followed = _ChoiceDeltas(deltas, choices, prompt_tokens)
    try:
        for d in followed:
            _merge(merged.setdefault(d["index"], {"index": d["index"]}), d)
    except ValueError as e:   # refused by the engine after submission (e.g. KV pool too small)
        raise APIError(400, str(e)) from None
    out = []
    for index in sorted(merged):
        d = merged[index]
        if choices.chat:
            out.append({"index": index, "message": {"role": "assistant", "content": d.get("content", "")},
                        "logprobs": d.get("logprobs"), "finish_reason": d.get("finish_reason"),
                        **{k: d[k] for k in ("token_ids",) if k in d}})
            for reader in (choices.reasoning, choices.tools):   # the answer after the reasoning has the calls
                out[-1] = out[-1] if reader is None else reader.message(out[-1])
        else:
            out.append({"index": index, "text": d.get("text", ""), "logprobs": d.get("logprobs"),
                        "finish_reason": d.get("finish_reason"),
                        **{k: d[k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids") if k in d}})
    top = {}   # a chat's one prompt: its prompt logprobs and ids are the response's (vLLM)
    scored = choices.prompt_logprobs(0) if choices.chat else None
    if scored is not None:
        top["prompt_logprobs"] = scored
    if choices.chat and choices.return_ids:
        top["prompt_token_ids"] = choices.prompt_ids[0]
    return {"choices": out, "usage": followed.usage(), **top}


def _merge(acc: dict, d: dict) -> None:
    acc["finish_reason"] = d["finish_reason"] or acc.get("finish_reason")
    key = "content" if "delta" in d else "text"
    acc[key] = acc.get(key, "") + (d["delta"].get("content", "") if "delta" in d else d["text"])
    acc.update({k: d[k] for k in ("prompt_logprobs", "prompt_token_ids") if k in d})
    if "token_ids" in d:
        acc["token_ids"] = acc.get("token_ids", []) + d["token_ids"]
    if d["logprobs"] is not None:
        lp = acc.setdefault("logprobs", {})
        for k, v in d["logprobs"].items():
            lp[k] = lp.get(k, []) + v
