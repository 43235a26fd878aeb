"""gpt-oss's harmony messages (jaxserve/server/harmony.py) read by the `openai_gptoss` reasoning
parser and the `openai` tool parser, on texts written by the format's rules (OpenAI's harmony
guide): whole texts, and streams cut anywhere agreeing with them through both readers as the
chat route chains them."""
import random

import pytest

from jaxserve.server.reasoning import reasoning_reader
from jaxserve.server.tool_parsers import OpenAI
from jaxserve.server.tools import ToolCalls, tool_calls

HARMONY = reasoning_reader("openai_gptoss", "<|start|>user<|message|>Hi<|end|><|start|>assistant")
THINK = "<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|>"
CALL = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}"
# gpt-oss's built-in tools (the harmony guide's browser and python), which a chat completion cannot run
SEARCH = "<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{\"query\": \"Paris\"}<|call|>"
PYTHON = "<|start|>assistant to=python<|channel|>analysis code<|message|>print(2 + 2)<|call|>"


@pytest.mark.parametrize("text,reasoning,answer", [
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is 4.", "User asks 2+2. Simple.", "It is 4."),
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>", "User asks 2+2. Simple.", "It is 4."),
    ("<|channel|>final<|message|>Hi <b>there</b>", "", "Hi <b>there</b>"),
    ("<|channel|>analysis<|message|>cut short", "cut short", ""),
    (THINK + "<|start|>assistant<|channel|>fin", "User asks 2+2. Simple.", ""),   # a header cut short
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.", "",
     "Checking.Done."),
    (THINK + CALL, "User asks 2+2. Simple.", CALL),                         # a call stays as it is
    (THINK + SEARCH, "User asks 2+2. Simple.{\"query\": \"Paris\"}", ""),   # a built-in tool's: reasoning
    (THINK + PYTHON + CALL, "User asks 2+2. Simple.print(2 + 2)", CALL),
    ("Plain text, not harmony.", None, "Plain text, not harmony."),
    ("", None, ""),
])
def test_reasoning_and_answer(text, reasoning, answer):
    assert HARMONY.parts(text) == (reasoning, answer)


@pytest.mark.parametrize("text,calls", [
    (THINK + CALL, [("get_weather", {"city": "Paris"})]),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.now<|channel|>commentary json"
     "<|message|>{}", [("now", {})]),                                        # the recipient after the role
    (CALL + "<|call|>", [("get_weather", {"city": "Paris"})]),
    (THINK + CALL[:-5], None),                                             # arguments cut short
    ("<|channel|>analysis to=browser.search<|message|>{\"query\": \"x\"}", None),   # a built-in tool: no call
    (SEARCH + CALL, [("get_weather", {"city": "Paris"})]),                  # ... passed over
    ("<|channel|>analysis to=container.exec<|message|>{\"cmd\": [\"ls\"]}<|call|>", None),
    (THINK + "<|start|>assistant<|channel|>final<|message|>4", None),
])
def test_function_calls(text, calls):
    parser = OpenAI()
    assert parser.calls(text[parser.begins(text):]) == calls


def stream(reader, text, cuts):
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    chunks = [{"index": 0, "delta": {"content": p}, "finish_reason": None, "logprobs": None} for p in pieces]
    chunks[-1]["finish_reason"] = "stop"
    return list(reader(iter(chunks)))


@pytest.mark.parametrize("text", [THINK + "<|start|>assistant<|channel|>final<|message|>a <| b |> c<|",
                                  THINK + CALL, THINK + SEARCH, THINK + PYTHON + CALL, "<|channel|>final<|message|>x",
                                  "<|cha", "Plain <|end|> text"])
def test_streams_cut_anywhere_agree_with_the_whole(text):
    """Reasoning, then the calls read from the answer (as the chat route chains them): the
    streamed deltas join into what the whole text gives, no special token's characters among them
    but the answer's own."""
    tools = tool_calls({"tools": [{"type": "function", "function": {"name": "get_weather"}}]}, "openai")
    reasoning, answer = HARMONY.parts(text)
    content, calls = tools.split(answer)
    rng = random.Random(0)
    for cuts in [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 3)) for _ in range(20)]:
        out = stream(lambda chunks: tools.stream(HARMONY.stream(chunks)), text, cuts)
        assert "".join(c["delta"].get("reasoning_content", "") for c in out) == (reasoning or "")
        assert "".join(c["delta"].get("content", "") for c in out) == content, cuts
        assert named(out[-1]["delta"].get("tool_calls")) == named(calls)


def named(calls):
    return calls and [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_format_is_read_with_special_tokens_kept_and_the_grammar_waits_for_the_answer():
    assert HARMONY.keeps_special_tokens and OpenAI.keeps_special_tokens
    assert HARMONY.grammar_after == "<|channel|>final<|message|>"
    assert isinstance(tool_calls({"tools": [{"type": "function", "function": {"name": "f"}}]}, "openai"), ToolCalls)
