"""Tool calls read from a choice's text (jaxserve/server/tools.py): the calls a forced tool_choice
constrained the output to, or, for tool_choice "auto", those the model wrote in its own syntax
(vLLM's `--tool-call-parser NAME`).

A parser answers two questions about a text: where calls begin, or may begin once more text
arrives (`begins`: the text before is the message's content, streamed as it comes; from there on
it is held back), and which calls the text from there holds (`calls`: (name, arguments) pairs, or
None when it is not a complete set of calls, and so stays text). A syntax that begins with a special
token reads the text with special tokens kept (`keeps_special_tokens`, as vLLM's mistral parser),
and a model family may require its own call ids (`call_id`).
"""
from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid

from jaxserve.server import harmony


def held_from(text: str, marker: str) -> int:
    """Where `marker` starts in `text`, or where a suffix of `text` that may grow into it does."""
    found = text.find(marker)
    if found >= 0:
        return found
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _call(obj, arguments_key: str) -> tuple[str, dict] | None:
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(arguments_key, {}), dict)):
        return None
    return obj["name"], obj.get(arguments_key, {})


class Parser:
    keeps_special_tokens = False   # the calls begin with a special token: the text must keep it

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"


class Forced(Parser):
    """A forced tool_choice's output: the whole text is JSON, a list of {"name", "parameters"}
    (`required`) or the named function's arguments."""

    def __init__(self, name: str | None):
        self.name = name

    def begins(self, text: str) -> int:
        return 0

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [(self.name, value)]
        calls = [_call(c, "parameters") for c in value] if isinstance(value, list) else [None]
        return None if None in calls else calls


class Hermes(Parser):
    """Qwen2.5, Qwen3, Hermes 2 and 3 (their chat templates ask for it): after any text, one or
    more `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    START, END = "<tool_call>", "</tool_call>"

    def begins(self, text: str) -> int:
        return held_from(text, self.START)

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        bodies = re.findall(rf"{re.escape(self.START)}(.*?)(?:{re.escape(self.END)}|$)", text, re.DOTALL)
        try:
            calls = [_call(json.loads(body), "arguments") for body in bodies]
        except ValueError:
            return None
        return calls if calls and None not in calls else None


class Llama3Json(Parser):
    """Llama 3.1 and 3.2 with tools in the user turn: the whole answer is one or more
    `{"name": ..., "parameters": {...}}` separated by `;`, after an optional `<|python_tag|>`."""
    TAG = "<|python_tag|>"

    def begins(self, text: str) -> int:
        start = text.lstrip()
        may_call = start.startswith(("{", self.TAG)) or self.TAG.startswith(start)   # "" too
        return 0 if may_call else len(text)

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        text, decoder, calls = text.strip().removeprefix(self.TAG).lstrip(), json.JSONDecoder(), []
        while text:
            try:
                obj, end = decoder.raw_decode(text)
            except ValueError:
                return None
            calls.append(_call(obj, "parameters" if "parameters" in obj else "arguments")
                         if isinstance(obj, dict) else None)
            text = text[end:].lstrip().removeprefix(";").lstrip()
        return calls if calls and None not in calls else None


class Mistral(Parser):
    """Mistral 7B Instruct v0.3, Nemo, Small and Large: after any text, the special token
    `[TOOL_CALLS]` and a JSON list of {"name": ..., "arguments": {...}}; from the v11 tokenizer
    (Mistral Small 3.1 and later) `[TOOL_CALLS]name[ARGS]{...}` per call. Call ids are 9 letters
    and digits: Mistral's chat templates refuse any other when the calls come back."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True

    def begins(self, text: str) -> int:
        return held_from(text, self.TAG)

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        calls = []
        for part in text.split(self.TAG)[1:]:
            try:
                if self.ARGS in part:
                    name, arguments = part.split(self.ARGS, 1)
                    calls.append(_call({"name": name.strip(), "arguments": json.loads(arguments)}, "arguments"))
                else:
                    value = json.loads(part)
                    calls += [_call(c, "arguments") for c in (value if isinstance(value, list) else [value])]
            except ValueError:
                return None
        return calls if calls and None not in calls else None

    def call_id(self) -> str:
        return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class Pythonic(Parser):
    """Llama 3.2 and 4, Gemma 3 (as vLLM's `pythonic`): the whole answer is a Python list of calls
    with keyword arguments whose values are literals, `[add(a=1, b=[2, 3]), now()]`, inside
    Llama 4's `<|python_start|>` ... `<|python_end|>` or not."""
    START, END = "<|python_start|>", "<|python_end|>"

    def begins(self, text: str) -> int:
        lead = text.lstrip()
        may_call = lead.startswith(("[", self.START)) or self.START.startswith(lead)   # "" too
        return 0 if may_call else len(text)

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        text = text.strip().removeprefix(self.START).removesuffix(self.END).strip()
        try:
            tree = ast.parse(text, mode="eval").body
            if not (isinstance(tree, ast.List) and tree.elts):
                return None
            calls = [(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords})
                     for c in tree.elts if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args
                     and all(k.arg is not None for k in c.keywords)]
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None
        return calls if len(calls) == len(tree.elts) else None


class OpenAI(Parser):
    """gpt-oss (harmony messages, server/harmony.py): each call is a message to `functions.NAME`
    whose content is the JSON arguments. With the `openai_gptoss` reasoning parser the text before
    them is the answer; a message to any other recipient (gpt-oss's built-in browser and python
    tools) is no call and is passed over (the reasoning parser reads it as reasoning), as vLLM's does."""
    keeps_special_tokens = True

    def begins(self, text: str) -> int:
        return min(held_from(text, harmony.START), held_from(text, harmony.CHANNEL))

    def calls(self, text: str) -> list[tuple[str, dict]] | None:
        calls = []
        for m in harmony.messages(text):
            if m.recipient is None or not m.recipient.startswith(harmony.FUNCTIONS):
                continue
            try:
                arguments = json.loads(m.content)
            except ValueError:
                return None
            name = m.recipient.removeprefix(harmony.FUNCTIONS)
            calls.append(_call({"name": name, "arguments": arguments}, "arguments"))
        return calls if calls and None not in calls else None


# --tool-call-parser NAME
PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral, "openai": OpenAI, "pythonic": Pythonic}
