"""Tool calls on /v1/chat/completions, through structured output.

`tool_choice: "required"` constrains the output to a JSON list of calls, each
`{"name": ..., "parameters": {...}}` with the named function's parameter schema (an anyOf over the
tools; one call at most with `parallel_tool_calls: false`); a named function
(`{"type": "function", "function": {"name": ...}}`) constrains it to that function's arguments.
The text is then returned as OpenAI `message.tool_calls` with `finish_reason: "tool_calls"` (in a
stream: one `delta.tool_calls` chunk per choice when it ends). An output cut short (`"length"`)
stays text. `"none"` ignores the tools. `"auto"` (the default when tools are given) would need
the model's own tool-call format to be recognised in free text, which is not built: 400.
"""
from __future__ import annotations

import dataclasses
import json
import uuid

from jaxserve.server.errors import APIError
from jaxserve.server.validation import field
from jaxserve.structured import StructuredOutput

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """What the request's tool_choice asks for: `name` the one function to call, or None for a
    list of calls to any of the tools."""
    constraint: StructuredOutput
    name: str | None

    def calls(self, text: str) -> list[dict] | None:
        """The OpenAI tool_calls in a choice's text, or None when it is not a complete call."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        pairs = [(self.name, value)] if self.name is not None else [(c["name"], c["parameters"]) for c in value]
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in pairs]

    def message(self, choice: dict) -> dict:
        """A finished non-streamed chat choice with its text turned into tool_calls."""
        calls = self.calls(choice["message"]["content"])
        if calls is None:
            return choice
        return {**choice, "message": {"role": "assistant", "content": None, "tool_calls": calls},
                "finish_reason": "tool_calls"}

    def stream(self, choices):
        """Streamed chat choices with each choice's text held back, then given as tool_calls in
        its last chunk."""
        texts: dict[int, str] = {}
        for c in choices:
            index, delta, finish = c["index"], dict(c["delta"]), c["finish_reason"]
            texts[index] = texts.get(index, "") + delta.pop("content", "")
            if finish is not None:
                calls = self.calls(texts[index])
                if calls is None:
                    delta["content"] = texts[index]
                else:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                    finish = "tool_calls"
            if delta or finish or c["logprobs"]:
                yield {**c, "delta": delta, "finish_reason": finish}


def tool_calls(body: dict) -> ToolCalls | None:
    """The request's tools and tool_choice, checked (400 naming the field), or None when the
    output is free text."""
    tools = field(body, "tools", lambda v: isinstance(v, list), "a list of tools", [])
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    functions = dict(_function(i, t) for i, t in enumerate(tools))
    if choice == "auto":
        raise APIError(400, "tool_choice 'auto' is not supported by this server: set tool_choice to 'required', "
                            "to a function ({\"type\": \"function\", \"function\": {\"name\": ...}}) or to 'none'",
                       param="tool_choice")
    if choice == "required":
        one = field(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean", True) is False
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                           "required": ["name", "parameters"]} for name, params in functions.items()]}
        schema = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one else {})}
        return ToolCalls(StructuredOutput.json_schema(schema), None)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolCalls(StructuredOutput.json_schema(functions[name]), name)


def _function(i: int, tool) -> tuple[str, dict]:
    """(name, parameter schema) of tools[i]."""
    fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            f"\"parameters\": {{...}}}}}}", param="tools")
    params = fn.get("parameters", NO_PARAMETERS)
    if not isinstance(params, dict):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return fn["name"], params
