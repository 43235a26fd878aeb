"""Request bodies -> checked Python values. Anything wrong raises APIError(400) naming the field.

Unknown fields are ignored (clients send extras such as `user` or `metadata`); known OpenAI fields
this server does not implement are rejected when set, rather than silently ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math

from flask import request

from jaxserve.beam_search import BeamSearchParams
from jaxserve.sampling_params import MAX_LOGPROBS, InvalidRequest, SamplingParams
from jaxserve.server.errors import APIError
from jaxserve.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_PROMPTS = 64
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Set to anything but these "off" values, these fields get a 400.
UNSUPPORTED = {"suffix": (None, ""), "functions": (None, [])}
# The fields that constrain the output, at most one per request: OpenAI's, vLLM's older guided_*
# and its structured_outputs object (one of OUTPUT_KINDS).
GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# OpenAI's reasoning_effort (vLLM's values), a chat template variable: gpt-oss's writes it in its
# system message ("Reasoning: low"), medium unless set.
REASONING_EFFORTS = ("low", "medium", "high")


def json_body() -> dict:
    """The request's JSON object (400 / 415 on anything else)."""
    if request.mimetype != "application/json":
        raise APIError(415, "Content-Type must be application/json")
    raw = request.get_data(cache=False)   # 413 past MAX_CONTENT_LENGTH
    try:
        body = json.loads(raw.decode("utf-8"))
        # Lone surrogates ("\ud800") parse but are not text: the tokenizer would choke on them.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeError:
        raise APIError(400, "request body is not valid UTF-8 text") from None
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"malformed JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_token_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(map(is_int, v))


def field(body: dict, name: str, check, what: str, default=None):
    """body[name] if it passes `check`; `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise APIError(400, f"'{name}' must be {what}, got {json.dumps(value)[:80]}", param=name)
    return value


def required(body: dict, name: str, check, what: str):
    """body[name], which must be there and pass `check`."""
    value = field(body, name, check, what)
    if value is None:
        raise APIError(400, f"'{name}' is required: {what}", param=name)
    return value


def reject_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"'{name}' is not supported by this server", param=name)


def sampling_params(body: dict, *, chat: bool, max_tokens: int | None, tenant: str | None = None,
                    tool_call: StructuredOutput | None = None, defaults: dict | None = None,
                    grammar_after: str = "", keep_special_tokens: bool = False,
                    lora_name: str | None = None) -> SamplingParams:
    """The sampling fields shared by completions and chat. `max_tokens` is the default when the
    body has neither max_completion_tokens nor max_tokens; `defaults` (the model's: sampling_params.py
    sampling_defaults) those of the fields it names. A `tenant` (from the API key) salts the
    prefix cache, with the body's cache_salt if any. `tool_call`: the output's constraint from the
    chat request's tools (jaxserve/server/tools.py); `grammar_after`: where the output's grammar
    starts (StructuredOutput.after; "" at once); `keep_special_tokens`: the text keeps them whatever
    the body says (a tool-call syntax that begins with one); `lora_name`: the LoRA adapter the
    body's `model` names (None: the served model)."""
    defaults = {**vars(SamplingParams()), **(defaults or {})}   # the model's, else OpenAI's
    reject_unsupported(body)
    structured = structured_output(body)
    if tool_call is not None:
        if structured is not None:
            raise APIError(400, f"'{structured[0]}' cannot be combined with a tool_choice that forces a tool call",
                           param=structured[0])
        structured = ("tool_choice", tool_call)
    if structured is not None and grammar_after:   # a thinking model's grammar waits for its answer
        structured = (structured[0], dataclasses.replace(structured[1], after=grammar_after))
    n = field(body, "n", is_int, "an integer", 1)
    best_of = field(body, "best_of", is_int, "an integer", n)
    if best_of != n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of")
    max_tokens = field(body, "max_completion_tokens", is_int, "an integer",
                       field(body, "max_tokens", is_int, "an integer", max_tokens))
    if chat:
        want = field(body, "logprobs", lambda v: isinstance(v, bool), "a boolean", False)
        top = field(body, "top_logprobs", is_int, "an integer", None)
        if top is not None and not want:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        logprobs = (top or 0) if want else None
        if body.get("stream") is True and body.get("prompt_logprobs") is not None:   # as vLLM
            raise APIError(400, "'prompt_logprobs' are not available with stream: true on chat",
                           param="prompt_logprobs")
    else:
        logprobs = field(body, "logprobs", is_int, "an integer", None)
    # vLLM's field; on completions also the legacy API's echo with logprobs (the prompt's come first)
    prompt_logprobs = field(body, "prompt_logprobs", is_int, "an integer",
                            logprobs if not chat and body.get("echo") is True else None)
    stop = field(body, "stop", lambda v: isinstance(v, (str, list)), "a string or a list of strings", [])
    if len(stop if isinstance(stop, list) else [stop]) > MAX_STOP_STRINGS:
        raise APIError(400, f"'stop' must hold at most {MAX_STOP_STRINGS} strings", param="stop")
    try:   # SamplingParams checks its values (ranges, non-empty stop strings) when built
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=field(body, "temperature", is_number, "a number", defaults["temperature"]),
            top_p=field(body, "top_p", is_number, "a number", defaults["top_p"]),
            top_k=field(body, "top_k", is_int, "an integer", defaults["top_k"]),
            min_p=field(body, "min_p", is_number, "a number", defaults["min_p"]),
            presence_penalty=field(body, "presence_penalty", is_number, "a number", 0.0),
            frequency_penalty=field(body, "frequency_penalty", is_number, "a number", 0.0),
            repetition_penalty=field(body, "repetition_penalty", is_number, "a number", defaults["repetition_penalty"]),
            seed=field(body, "seed", lambda v: is_int(v) and -2**63 <= v < 2**64, "a 64-bit integer", None),
            stop=stop,
            stop_token_ids=field(body, "stop_token_ids", lambda v: isinstance(v, list) and all(map(is_int, v)),
                                 "a list of token ids", []),
            allowed_token_ids=field(body, "allowed_token_ids", lambda v: isinstance(v, list) and all(map(is_int, v)),
                                    "a list of token ids", None),
            bad_words=field(body, "bad_words", lambda v: isinstance(v, list) and all(isinstance(w, str) for w in v),
                            "a list of strings", []),
            ignore_eos=field(body, "ignore_eos", lambda v: isinstance(v, bool), "a boolean", False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=field(body, "min_tokens", is_int, "an integer", 0),
            logit_bias=_logit_bias(body),
            include_stop_str_in_output=field(body, "include_stop_str_in_output", lambda v: isinstance(v, bool),
                                             "a boolean", False),
            skip_special_tokens=field(body, "skip_special_tokens", lambda v: isinstance(v, bool), "a boolean",
                                      True) and not keep_special_tokens,
            truncate_prompt_tokens=field(body, "truncate_prompt_tokens", is_int, "an integer", None),
            cache_salt=cache_salt(body, tenant),
            structured_output=structured and structured[1],
            lora_name=lora_name,
        )
    except InvalidRequest as e:
        param = {"logprobs": "top_logprobs" if chat else "logprobs",
                 "structured_output": structured and structured[0]}.get(e.param, e.param)
        raise APIError(400, str(e), param=param) from None


def beam_search(body: dict, params: SamplingParams) -> BeamSearchParams | None:
    """vLLM's `use_beam_search` (jaxserve/beam_search.py): `n` beams (at most MAX_LOGPROBS // 2),
    `length_penalty`, max_tokens and ignore_eos from `params`; the sampling settings do not apply
    (a search takes the most likely tokens). What a search cannot honour is a 400: stop strings
    and stop tokens, min_tokens, prompt logprobs, an output constraint."""
    if not field(body, "use_beam_search", lambda v: isinstance(v, bool), "a boolean", False):
        return None
    for name, used in (("stop", params.stop), ("stop_token_ids", params.stop_token_ids),
                       ("min_tokens", params.min_tokens > 0), ("prompt_logprobs", params.prompt_logprobs is not None),
                       ("an output constraint", params.structured_output is not None)):
        if used:
            raise APIError(400, f"{name} cannot be combined with use_beam_search", param="use_beam_search")
    if params.n > MAX_LOGPROBS // 2:
        raise APIError(400, f"n (the beam width) must be at most {MAX_LOGPROBS // 2} with use_beam_search", param="n")
    return BeamSearchParams(params.n, params.max_tokens, params.ignore_eos,
                            field(body, "length_penalty", is_number, "a number", 1.0))


def structured_output(body: dict) -> tuple[str, StructuredOutput] | None:
    """(the field that set it, the output's grammar) from OpenAI's `response_format`, vLLM's
    `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` or its `structured_outputs`
    ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}); None for free text. Whether
    the grammar compiles is SamplingParams' check."""
    given = [name for name in GUIDED if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"set at most one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        kinds = [k for k in OUTPUT_KINDS if isinstance(value, dict) and value.get(k) not in (None, False)]
        if len(kinds) != 1:
            raise APIError(400, "'structured_outputs' must set one of " + ", ".join(OUTPUT_KINDS), param=name)
        return name, _constraint(kinds[0], value[kinds[0]], name)
    return name, _constraint(name.removeprefix("guided_"), value, name)


def _constraint(kind: str, value, name: str) -> StructuredOutput:
    """The constraint of one of OUTPUT_KINDS, given as `value` in the field `name`."""
    if kind == "json_object":
        return StructuredOutput.json_schema({"type": "object"})
    if kind in ("regex", "grammar"):
        if not isinstance(value, str):
            raise APIError(400, f"'{name}' must give the {kind} as a string, got {json.dumps(value)[:80]}", param=name)
        return StructuredOutput(kind, value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise APIError(400, f"'{name}' must give the choices as a non-empty list of strings", param=name)
        return StructuredOutput("choice", tuple(value))
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"'{name}' is not valid JSON: {e}", param=name) from None
    if not isinstance(value, (dict, bool)):
        raise APIError(400, f"'{name}' must give a JSON schema (an object)", param=name)
    return StructuredOutput.json_schema(value)


def _response_format(value) -> tuple[str, StructuredOutput] | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutput.json_schema({"type": "object"})
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not (isinstance(spec, dict) and isinstance(spec.get("schema"), dict)):
        raise APIError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       param="response_format")
    return "response_format", StructuredOutput.json_schema(spec["schema"])


def _logit_bias(body: dict) -> dict[int, float]:
    """`logit_bias`: {"token id": bias} (JSON keys are strings); SamplingParams checks the ranges."""
    bias = field(body, "logit_bias", lambda v: isinstance(v, dict) and all(map(is_number, v.values())),
                 "an object mapping token ids to numbers", {})
    try:
        return {int(k): float(v) for k, v in bias.items()}
    except ValueError:
        raise APIError(400, "'logit_bias' keys must be token ids", param="logit_bias") from None


def cache_salt(body: dict, tenant: str | None) -> str | None:
    """The prefix-cache salt: the body's `cache_salt`, under the tenant's own when there is one, so
    no body can reach another tenant's pages."""
    salt = field(body, "cache_salt", lambda v: isinstance(v, str) and v, "a non-empty string", None)
    return salt if tenant is None else json.dumps([tenant, salt])


def stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats) from `stream` and `stream_options`."""
    stream = field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    include_usage = field(options, "include_usage", lambda v: isinstance(v, bool), "a boolean", False)
    continuous = field(options, "continuous_usage_stats", lambda v: isinstance(v, bool), "a boolean", False)
    if options and not stream:
        raise APIError(400, "'stream_options' needs 'stream': true", param="stream_options")
    return stream, include_usage, continuous


def prompts(body: dict, encode, name: str = "prompt", limit: int = MAX_PROMPTS) -> list[tuple[str | None, list[int]]]:
    """body[name] (`prompt`; embeddings' `input`) as a string, strings, token ids or lists of token
    ids -> [(text or None, ids)], at most `limit` of them."""
    p = body.get(name)
    what = "a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(map(is_token_ids, p))):
        items = p
    elif is_token_ids(p):
        items = [p]
    else:
        raise APIError(400, f"'{name}' must be {what} (non-empty)", param=name)
    if len(items) > limit:
        raise APIError(400, f"at most {limit} prompts per request", param=name)
    return [(x, encode(x)) if isinstance(x, str) else (None, list(x)) for x in items]


def messages(body: dict) -> list[dict]:
    """Chat messages, normalised for the chat template: content a string (text parts joined by
    newlines, as vLLM), "developer" becomes "system"; an assistant's tool_calls keep each call's
    id, name and arguments, parsed to an object (templates write them with tojson), and it may
    then have no content; a tool message keeps its tool_call_id. Any message keeps its `name`.
    An assistant's earlier reasoning (`reasoning_content`, or `reasoning` as newer clients send it)
    reaches the template under both names templates read: Qwen3's `reasoning_content`, gpt-oss's
    `thinking`."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                f"{json.dumps(role)[:40]}", param="messages")
        if content is None and calls and role == "assistant":
            content = ""
        if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise APIError(400, f"messages[{i}].content parts must all be text parts", param="messages")
            content = "\n".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                           param="messages")
        message = {"role": "system" if role == "developer" else role, "content": content}
        if calls is not None and role == "assistant":
            message["tool_calls"] = _tool_calls(i, calls)
        message.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if role == "assistant" and isinstance(reasoning, str):
            message["reasoning_content"] = message["thinking"] = reasoning
        out.append(message)
    return out


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool calls, each function's arguments parsed from their JSON text."""
    shape = (f"messages[{i}].tool_calls must be a list of {{\"type\": \"function\", \"function\": "
             f"{{\"name\": ..., \"arguments\": \"<JSON>\"}}}}")
    if not isinstance(calls, list):
        raise APIError(400, shape, param="messages")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, shape, param="messages")
        arguments = fn.get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise APIError(400, f"messages[{i}].tool_calls: the arguments of {fn['name']!r} are not JSON",
                               param="messages") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def chat_template_options(body: dict, generation_prompt: bool = True) -> dict:
    """How the chat template renders the messages (vLLM's request fields): a generation prompt
    for the assistant's turn (by default, unless `generation_prompt` is false: a pooling request's)
    or the last message continued; the request's tools; `chat_template_kwargs`, variables for the
    template (e.g. Qwen3's enable_thinking), and `reasoning_effort` among them."""
    start = field(body, "add_generation_prompt", lambda v: isinstance(v, bool), "a boolean", generation_prompt)
    cont = field(body, "continue_final_message", lambda v: isinstance(v, bool), "a boolean", False)
    if start and cont:
        raise APIError(400, "'continue_final_message' needs 'add_generation_prompt': false (the first "
                            "continues the last message, the second starts a new one)", param="continue_final_message")
    extra = field(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    effort = field(body, "reasoning_effort", lambda v: v in REASONING_EFFORTS, f"one of {', '.join(REASONING_EFFORTS)}")
    if effort is not None:
        if extra.get("reasoning_effort", effort) != effort:
            raise APIError(400, "'reasoning_effort' and chat_template_kwargs' reasoning_effort differ",
                           param="reasoning_effort")
        extra = {**extra, "reasoning_effort": effort}
    tools = field(body, "tools", lambda v: isinstance(v, list), "a list of tools", None)
    return {**extra, "add_generation_prompt": start, "continue_final_message": cont, "tools": tools}
