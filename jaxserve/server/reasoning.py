"""A thinking model's reasoning, apart from its answer (vLLM's `--reasoning-parser NAME`): chat
choices carry it as `message.reasoning_content` (streamed: `delta.reasoning_content`), the answer
after it as `content`, which tool calls are then read from.

    deepseek_r1  the thinking starts in the prompt (DeepSeek-R1, QwQ, Qwen3 thinking-2507): all text
                 up to `</think>` is reasoning (a leading `<think>` dropped); with none, all of it.
    qwen3        Qwen3 (hybrid): a text that begins with `<think>` reasons until `</think>`; any
                 other (enable_thinking false) is all answer.
    openai_gptoss gpt-oss (harmony messages, server/harmony.py): the analysis channel is the
                 reasoning, the others the answer; a call's message stays in the answer as it is,
                 for the `openai` tool parser; a built-in tool's (browser, python) is
                 reasoning. Text not in the format is all answer.

Either way a prompt whose last think tag is `<think>` has begun the thinking, and one whose last is
`</think>` has ended it (a template that turns thinking off writes an empty block). A grammar
(structured output, a forced tool call) waits for `</think>` unless the prompt has ended the
thinking, as vLLM's does: the model thinks freely, then answers in the grammar.
"""
from __future__ import annotations

import functools

from jaxserve.server import harmony
from jaxserve.server.tool_parsers import held_from

START, END = "<think>", "</think>"


class Reasoning:
    keeps_special_tokens = False   # the format's tags are special tokens: the text must keep them

    def __init__(self, starts_in_prompt: bool, grammar_after: str = END):
        self.starts_in_prompt = starts_in_prompt
        self.grammar_after = grammar_after   # where a grammar starts (StructuredOutput.after)

    def parts(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, answer) of a choice's text (reasoning None: the text does not reason). Not
        `final`: what may still grow into a tag is in neither."""
        lead = text.lstrip()
        if not final and lead and START.startswith(lead) and lead != START:
            return "", ""   # "<thi": a start tag, or text, once more comes
        if lead.startswith(START):
            text = lead[len(START):]
        elif not self.starts_in_prompt:
            return (("", "") if not final and not lead else (None, text))
        end = text.find(END)
        if end >= 0:
            return text[:end], text[end + len(END):]
        return (text, "") if final else (text[:held_from(text, END)], "")

    def message(self, choice: dict) -> dict:
        """A finished non-streamed chat choice, its reasoning apart."""
        reasoning, answer = self.parts(choice["message"]["content"])
        if reasoning is None:
            return choice
        return {**choice, "message": {**choice["message"], "content": answer or None, "reasoning_content": reasoning}}

    def stream(self, choices):
        """Streamed chat choices with each delta's text split into reasoning_content and content."""
        texts: dict[int, str] = {}
        sent: dict[int, tuple[int, int]] = {}
        for c in choices:
            index, delta, finish = c["index"], dict(c["delta"]), c["finish_reason"]
            text = texts[index] = texts.get(index, "") + delta.pop("content", "")
            reasoning, answer = self.parts(text, final=finish is not None)
            done_reasoning, done_answer = sent.get(index, (0, 0))
            if reasoning and len(reasoning) > done_reasoning:
                delta["reasoning_content"] = reasoning[done_reasoning:]
            if len(answer) > done_answer:
                delta["content"] = answer[done_answer:]
            sent[index] = (max(done_reasoning, len(reasoning or "")), max(done_answer, len(answer)))
            if delta or finish or c["logprobs"] or c.get("token_ids"):
                yield {**c, "delta": delta}


class Harmony(Reasoning):
    keeps_special_tokens = True

    def __init__(self):
        super().__init__(starts_in_prompt=False, grammar_after=harmony.FINAL)

    def parts(self, text: str, final: bool = True) -> tuple[str | None, str]:
        known = harmony.begins(text, final)
        if not known:
            return ("", "") if known is None else (None, text)
        reasoning, answer = "", ""
        for m in harmony.messages(text, final):
            if m.recipient is not None and m.recipient.startswith(harmony.FUNCTIONS):   # a call: the rest as it is
                return reasoning, answer + text[m.start:]                               # (tool_parsers.OpenAI)
            if m.channel == "analysis" or m.recipient is not None:   # a built-in tool's message: reasoning too
                reasoning += m.content
            else:
                answer += m.content
        return reasoning, answer


def _think_tags(starts_in_prompt: bool, prompt: str) -> Reasoning:
    """A think-tag parser's reader, by the rendered prompt's last tag."""
    start, end = prompt.rfind(START), prompt.rfind(END)
    if start == end:   # no tag: as the parser says
        return Reasoning(starts_in_prompt)
    return Reasoning(start > end, END if start > end else "")


# --reasoning-parser NAME: the reader of a chat request's reasoning, by its rendered prompt
PARSERS = {"deepseek_r1": functools.partial(_think_tags, True), "qwen3": functools.partial(_think_tags, False),
           "openai_gptoss": lambda prompt: Harmony()}


def reasoning_reader(parser: str | None, prompt: str) -> Reasoning | None:
    """The reader of a chat request's reasoning (None without a parser), by its rendered `prompt`."""
    return None if parser is None else PARSERS[parser](prompt)
