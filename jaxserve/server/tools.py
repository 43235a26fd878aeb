"""Tool calls on /v1/chat/completions.

`tool_choice: "required"` constrains the output, through structured output, to a JSON list of
calls, each `{"name": ..., "parameters": {...}}` with the named function's parameter schema (an
anyOf over the tools; one call at most with `parallel_tool_calls: false`); a named function
(`{"type": "function", "function": {"name": ...}}`) constrains it to that function's arguments.
In the harmony format (gpt-oss: a prompt that ends with `<|start|>assistant`) a forced call's
output begins in the prompt (`prefill`), so that the grammar holds from the first token: a named
function's call header (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`,
the model then writes the arguments, as it writes a call of its own); "required" the final
channel's (`<|channel|>final<|message|>`), where the list of calls is written, since a call's header
names its function before the special token that ends it. The model does not reason first.
`"auto"` (the default when tools are given) leaves the output free and reads the calls the model
writes in its own syntax, when the server was started with a parser for it
(`--enable-auto-tool-choice --tool-call-parser NAME` of tool_parsers.PARSERS, as vLLM; a 400 otherwise);
the text before them is the message's content. Calls are returned as OpenAI `message.tool_calls`
with `finish_reason: "tool_calls"` (in a stream: the content as it comes, then one
`delta.tool_calls` chunk per choice when it ends). Text that holds no complete call (an output cut
short by `"length"`, say) stays text. `"none"` ignores the tools.
"""
from __future__ import annotations

import dataclasses
import json

from jaxserve.server import harmony
from jaxserve.server.errors import APIError
from jaxserve.server.tool_parsers import PARSERS, Forced
from jaxserve.server.validation import field
from jaxserve.structured import StructuredOutput

NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolCalls:
    """What the request's tool_choice asks for: the output's `constraint` (None: free text) and
    the `parser` that reads calls from it (jaxserve/server/tool_parsers.py)."""
    constraint: StructuredOutput | None
    parser: object

    def prefill(self, prompt: str) -> str:
        """What the output of a forced call begins with, written after a harmony `prompt`; "" after
        any other."""
        if self.constraint is None or not prompt.endswith(harmony.ASSISTANT):
            return ""
        return harmony.FINAL if self.parser.name is None else harmony.call_header(self.parser.name)

    def split(self, text: str) -> tuple[str, list[dict] | None]:
        """(content, OpenAI tool_calls) of a choice's text; no calls: (text, None)."""
        begins = self.parser.begins(text)
        calls = self.parser.calls(text[begins:])
        if calls is None:
            return text, None
        return text[:begins], [{"id": self.parser.call_id(), "type": "function",
                                "function": {"name": name, "arguments": json.dumps(arguments)}} for name, arguments in calls]

    def message(self, choice: dict) -> dict:
        """A finished non-streamed chat choice with its calls as tool_calls."""
        content, calls = self.split(choice["message"]["content"] or "")
        if calls is None:
            return choice
        return {**choice, "message": {**choice["message"], "content": content or None, "tool_calls": calls},
                "finish_reason": "tool_calls"}

    def stream(self, choices):
        """Streamed chat choices: each choice's text up to where calls (may) begin as it comes,
        the rest held back and given as tool_calls in its last chunk (or as text, if no call)."""
        texts: dict[int, str] = {}
        sent: dict[int, int] = {}
        for c in choices:
            index, delta, finish = c["index"], dict(c["delta"]), c["finish_reason"]
            text = texts[index] = texts.get(index, "") + delta.pop("content", "")
            done = sent.get(index, 0)
            if finish is None:
                upto = max(done, self.parser.begins(text))
                calls = None
            else:
                content, calls = self.split(text)
                upto = len(content)
            if upto > done:
                delta["content"], sent[index] = text[done:upto], upto
            if calls is not None:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                finish = "tool_calls"
            if delta or finish or c["logprobs"] or c.get("token_ids"):
                yield {**c, "delta": delta, "finish_reason": finish}


def tool_calls(body: dict, auto_parser: str | None = None) -> ToolCalls | None:
    """The request's tools and tool_choice, checked (400 naming the field), or None when the
    output is free text with no calls to read. `auto_parser`: the server's parser for "auto"."""
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
        if auto_parser is None:
            raise APIError(400, "tool_choice 'auto' needs a server started with --enable-auto-tool-choice "
                                "--tool-call-parser NAME: set tool_choice to 'required', to a function "
                                "({\"type\": \"function\", \"function\": {\"name\": ...}}) or to 'none'",
                           param="tool_choice")
        return ToolCalls(None, PARSERS[auto_parser]())
    if choice == "required":
        one = field(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "a boolean", True) is False
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                           "required": ["name", "parameters"]} for name, params in functions.items()]}
        schema = {"type": "array", "items": call, "minItems": 1, **({"maxItems": 1} if one else {})}
        return ToolCalls(StructuredOutput.json_schema(schema), Forced(None))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if name is None:
        raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if name not in functions:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolCalls(StructuredOutput.json_schema(functions[name]), Forced(name))


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
