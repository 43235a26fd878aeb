"""OpenAI's harmony format, which gpt-oss writes: a completion's messages, read for its reasoning
(server/reasoning.py, `--reasoning-parser openai_gptoss`) and its function calls
(server/tool_parsers.py, `--tool-call-parser openai`), the names vLLM gives them.

gpt-oss's chat template ends the prompt with `<|start|>assistant`, so a completion is one or more
messages, the first without its `<|start|>`:

    [<|start|>assistant]HEADER<|message|>CONTENT<|end|>

HEADER names the channel: `<|channel|>analysis` (reasoning), `<|channel|>final` (the answer) or
`<|channel|>commentary` (words to the user, or a call); a call names its recipient,
`to=functions.NAME`, after the channel or after the role, and its content is the arguments
(`<|constrain|>json`). A message to a built-in tool (`to=browser.search`, `to=python`,
`to=container.exec`) is the model's own work, which a chat completion cannot run: read as
reasoning, never as content or a call (vLLM's `openai` tool parser calls only `functions.`).
The last message ends with a stop token instead of `<|end|>`: `<|return|>` after the answer,
`<|call|>` after a call; the text does not hold it unless asked to. All of these are special
tokens: the text is read with special tokens kept.
"""
from __future__ import annotations

import re
from typing import NamedTuple

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
FUNCTIONS = "functions."   # a call's recipient prefix; the others are gpt-oss's built-in tools (browser, python)
ENDS = ("<|end|>", "<|return|>", "<|call|>")
# Where the answer's content begins: a grammar (structured output) applies from there.
FINAL = CHANNEL + "final" + MESSAGE
ASSISTANT = START + "assistant"   # how gpt-oss's chat template ends a prompt


def call_header(name: str) -> str:
    """The header of a call of the function `name` (after `<|start|>assistant`): its arguments follow."""
    return f"{CHANNEL}commentary to={FUNCTIONS}{name} <|constrain|>json{MESSAGE}"


class Message(NamedTuple):
    start: int               # where the message begins in the completion (its <|start|> or header)
    channel: str             # "" when the header names none
    recipient: str | None    # "functions.NAME" for a call
    content: str


def begins(text: str, final: bool) -> bool | None:
    """Whether `text` is in the harmony format (None, not `final`: too short to tell yet)."""
    if text.startswith((START, CHANNEL)):
        return True
    return None if not final and (START.startswith(text) or CHANNEL.startswith(text)) else False


def messages(text: str, final: bool = True) -> list[Message]:
    """The messages of a completion whose headers are whole. Not `final`: the last message's
    content without a tail that may still grow into a special token (`<|` with no `|>` yet,
    or a last `<`)."""
    out, pos = [], 0
    while pos < len(text):
        start = pos
        if text.startswith(START, pos):
            pos += len(START)
        body = text.find(MESSAGE, pos)
        if body < 0:   # a header still coming, or cut short
            break
        header, pos = text[pos:body], body + len(MESSAGE)
        end, marker = min(((text.find(m, pos), m) for m in ENDS if m in text[pos:]), default=(len(text), ""))
        content = text[pos:end]
        if not marker and not final:
            tail = len(content) - 1 if content.endswith("<") else content.rfind("<|")
            if tail >= 0 and "|>" not in content[tail:]:
                content = content[:tail]
        channel = re.search(r"<\|channel\|>(\w+)", header)
        recipient = re.search(r"to=([^\s<]+)", header)
        out.append(Message(start, channel.group(1) if channel else "", recipient and recipient.group(1), content))
        pos = end + len(marker)
    return out
