"""OpenAI's Responses API, /v1/responses, over the chat route (as vLLM serves it).

The body becomes a chat request: `input` (a string, or items: messages with text parts, earlier
`function_call`s and their `function_call_output`s) the messages, `instructions` a system message
before them, `max_output_tokens` max_tokens, `text.format` response_format, `reasoning.effort`
reasoning_effort, function `tools` chat tools. The chat completion becomes a Response whose
`output` holds a `reasoning` item (with a reasoning parser), a `message` item with the text, and
a `function_call` item per tool call; `status` is "incomplete" when max_output_tokens cut it.
Streamed, OpenAI's events from `response.created` to `response.completed` (or
`response.incomplete`), numbered by sequence_number; whole, the Response those events end with
(one path builds both). With `include: ["message.output_text.logprobs"]` (or `top_logprobs`
alone) each output_text and each of its deltas carry the chat logprobs of their tokens, with
`top_logprobs` alternatives (default 0). Reasoning and tool-call tokens have none in OpenAI's
schema; a delta that both ends the reasoning and starts the answer counts as the answer's.

Stateless: nothing is stored (`store` is answered false), so `previous_response_id`, `background`
and `conversation` get a 400: send the whole conversation in `input`.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid

from flask import Blueprint, current_app, jsonify

from jaxserve.server.errors import APIError
from jaxserve.server.openai_api import chunks, follow, submit_chat
from jaxserve.server.sse import sse_response
from jaxserve.server.validation import GUIDED, field, json_body

bp = Blueprint("responses", __name__)
STATEFUL = ("previous_response_id", "background", "conversation")
# Fields a Responses body may carry as it would on chat: OpenAI's, and vLLM's extras (its guided_*
# and structured_outputs among them; text.format is the Responses API's response_format).
PASSED_ON = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "seed", "top_k", "min_p", "stop",
             "stop_token_ids", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
             "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "truncate_prompt_tokens",
             "timeout", "chat_template_kwargs", "cache_salt", *(name for name in GUIDED if name != "response_format"))
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "assistant", "system", "developer")
LOGPROBS = "message.output_text.logprobs"   # the `include` entry that asks for them (others: nothing to add)


@bp.post("/v1/responses")
def create_response():
    host = current_app.extensions["jaxserve"]
    body = json_body()
    submitted = submit_chat(host, chat_body(body), request_id=f"resp_{uuid.uuid4().hex}")
    response = _Response(body, submitted.model, submitted.request_id)
    events = response.events(chunks(follow(host, submitted), submitted.choices, {}, True, False,
                                    submitted.prompt_tokens))
    if field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False):
        return sse_response(events)
    try:
        *_, last = events
    except ValueError as e:   # refused by the engine after submission (e.g. KV pool too small)
        raise APIError(400, str(e)) from None
    return jsonify(last["response"])


def chat_body(body: dict) -> dict:
    """The chat request a Responses body asks for (400 naming the field it cannot take)."""
    for name in STATEFUL:
        if body.get(name):
            raise APIError(400, f"'{name}' is not supported: this server stores no responses; send the whole "
                                f"conversation in 'input'", param=name)
    chat = {k: body[k] for k in PASSED_ON if k in body}
    messages = _messages(body.get("input"))
    instructions = field(body, "instructions", lambda v: isinstance(v, str), "a string", None)
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(i, t) for i, t in enumerate(field(body, "tools", lambda v: isinstance(v, list),
                                                                 "a list of tools", []))]
    if "tool_choice" in body:
        choice = body["tool_choice"]
        named = isinstance(choice, dict) and choice.get("type") == "function"
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}} if named else choice
    text_format = field(field(body, "text", lambda v: isinstance(v, dict), "an object", {}), "format",
                        lambda v: isinstance(v, dict) and isinstance(v.get("type"), str),
                        "an object with a 'type'", {"type": "text"})
    if text_format["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: text_format[k] for k in ("name", "schema", "strict", "description") if k in text_format}}
    elif text_format["type"] != "text":
        chat["response_format"] = text_format
    reasoning = field(body, "reasoning", lambda v: isinstance(v, dict), "an object", {})
    if reasoning.get("effort") is not None:   # checked as chat's reasoning_effort
        chat["reasoning_effort"] = reasoning["effort"]
    include = field(body, "include", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                    "a list of strings", [])
    if LOGPROBS in include or body.get("top_logprobs") is not None:   # checked as chat's top_logprobs
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    return chat


def _messages(items) -> list[dict]:
    """Chat messages of `input`: a string is one user message; function calls in a row make one
    assistant message's tool_calls, and each call's output a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty list of items", param="input")
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ROLES:
                raise APIError(400, f"input[{i}].role must be one of {', '.join(ROLES)}", param="input")
            out.append({"role": item["role"], "content": _text(i, item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind != "reasoning":   # a model's reasoning is not shown to it again
            raise APIError(400, f"input[{i}] must be a message, function_call, function_call_output or "
                                f"reasoning item, got {json.dumps(kind)[:40]}", param="input")
    return out


def _text(i: int, content):
    """A message's content as chat takes it: a string, or its text parts' texts."""
    if isinstance(content, list):
        if not all(isinstance(c, dict) and c.get("type") in TEXT_PARTS and isinstance(c.get("text"), str)
                   for c in content):
            raise APIError(400, f"input[{i}].content parts must be text parts ({', '.join(TEXT_PARTS)})",
                           param="input")
        return [{"type": "text", "text": c["text"]} for c in content]
    if not isinstance(content, str):
        raise APIError(400, f"input[{i}].content must be a string or a list of text parts", param="input")
    return content


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(400, f"tools[{i}] must be a function tool ({{\"type\": \"function\", \"name\": ..., "
                            f"\"parameters\": {{...}}}}): this server runs no built-in tools", param="tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters", "strict")
                                             if k in tool}}


class _Response:
    """The Response object of one request, built from its chat output (whole, or as it streams)."""

    def __init__(self, body: dict, model: str, response_id: str):
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.echo = {k: body.get(k, default) for k, default in (
            ("instructions", None), ("max_output_tokens", None), ("temperature", None), ("top_p", None),
            ("tools", []), ("tool_choice", "auto"), ("parallel_tool_calls", True), ("reasoning", None),
            ("text", {"format": {"type": "text"}}), ("metadata", {}), ("truncation", "disabled"), ("user", None))}
        self.output: list[dict] = []
        self._ids = itertools.count()

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.id.removeprefix('resp_')}_{next(self._ids)}"

    def body(self, finish_reason: str | None, usage: dict | None, status: str | None = None) -> dict:
        cut = finish_reason == "length"
        status = status or ("incomplete" if cut else "completed")
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "error": None, "output": self.output, **self.echo, "store": False, "previous_response_id": None,
                "usage": usage and {
                    "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                    "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"]}}

    def _reasoning(self, text: str) -> dict:
        return {"type": "reasoning", "id": self._item_id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self._item_id("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}

    def _call(self, call: dict, status: str) -> dict:
        return {"type": "function_call", "id": self._item_id("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def events(self, chat_chunks):
        """The stream's events from the chat stream's chunks (its last one: the usage)."""
        seq = itertools.count()

        def event(kind: str, **fields) -> dict:
            return {"type": f"response.{kind}", "sequence_number": next(seq), **fields}

        yield event("created", response=self.body(None, None, "in_progress"))
        yield event("in_progress", response=self.body(None, None, "in_progress"))
        open_item, text, logprobs, finish, usage = None, "", [], None, None   # the item being streamed, its text
        held = []   # logprobs of tokens whose text has not come yet

        def close():
            index, item = len(self.output) - 1, self.output[-1]
            if item["type"] == "reasoning":
                item["content"][0]["text"] = text
                yield event("reasoning_text.done", item_id=item["id"], output_index=index, content_index=0, text=text)
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
                item.update(status="completed", content=[part])
                yield event("output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                            logprobs=logprobs)
                yield event("content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            yield event("output_item.done", output_index=index, item=item)

        for chunk in chat_chunks:
            usage = chunk.get("usage", usage)
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
                delta = choice["delta"]
                # A token held back (part of a character) comes with no text: its logprobs wait for
                # the next text, and go with it if that is the answer's.
                held += (choice.get("logprobs") or {}).get("content") or []
                for kind, key in (("reasoning", "reasoning_content"), ("message", "content")):
                    if not delta.get(key):
                        continue
                    if open_item != kind:
                        if open_item is not None:
                            yield from close()
                        open_item, text, logprobs = kind, "", []
                        self.output.append(self._reasoning("") if kind == "reasoning"
                                           else self._message("", "in_progress"))
                        index, item = len(self.output) - 1, self.output[-1]
                        yield event("output_item.added", output_index=index, item=item)
                        if kind == "message":
                            yield event("content_part.added", item_id=item["id"], output_index=index,
                                        content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                               "logprobs": []})
                    text += delta[key]
                    index, item_id = len(self.output) - 1, self.output[-1]["id"]
                    if kind == "reasoning":
                        yield event("reasoning_text.delta", item_id=item_id, output_index=index, content_index=0,
                                    delta=delta[key])
                        held = held if delta.get("content") else []
                    else:
                        logprobs += held
                        yield event("output_text.delta", item_id=item_id, output_index=index, content_index=0,
                                    delta=delta[key], logprobs=held)
                        held = []
                for call in delta.get("tool_calls") or ():
                    held = []
                    if open_item is not None:
                        yield from close()
                        open_item = None
                    item = self._call(call, "completed")
                    self.output.append(item)
                    index = len(self.output) - 1
                    yield event("output_item.added", output_index=index, item={**item, "arguments": "",
                                                                               "status": "in_progress"})
                    yield event("function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                    yield event("function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])
                    yield event("output_item.done", output_index=index, item=item)
        if open_item is not None:
            yield from close()
        body = self.body(finish, usage)
        yield event("incomplete" if body["status"] == "incomplete" else "completed", response=body)
