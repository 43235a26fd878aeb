"""Reasoning set apart from the answer (jaxserve/server/reasoning.py): the split of whole texts,
and streams cut at every place agreeing with it, no tag's characters in either part. Served end
to end in tests/test_server.py."""
import random

import pytest

from jaxserve.server.reasoning import Reasoning, reasoning_reader

R1, QWEN3 = Reasoning(starts_in_prompt=True), Reasoning(starts_in_prompt=False)


@pytest.mark.parametrize("reader,text,reasoning,answer", [
    (R1, "Let me see: 2+2.\n</think>\n\nIt is 4.", "Let me see: 2+2.\n", "\n\nIt is 4."),
    (R1, "<think>\nhmm</think>4", "\nhmm", "4"),
    (R1, "still thinking when cut", "still thinking when cut", ""),
    (R1, "</think>4", "", "4"),
    (QWEN3, "<think>\nhmm, 2+2</think>\n\nIt is 4.", "\nhmm, 2+2", "\n\nIt is 4."),
    (QWEN3, "\n<think>x</think>y", "x", "y"),
    (QWEN3, "It is 4.", None, "It is 4."),
    (QWEN3, "<thin", None, "<thin"),
    (QWEN3, "", None, ""),
    (QWEN3, "<think>cut", "cut", ""),
])
def test_reasoning_and_answer(reader, text, reasoning, answer):
    assert reader.parts(text) == (reasoning, answer)
    message = reader.message({"message": {"role": "assistant", "content": text}})["message"]
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == (answer or None if reasoning is not None else text)


def stream(reader, text: str, cuts: list[int]):
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    chunks = [{"index": 0, "delta": {"content": p}, "finish_reason": None, "logprobs": None} for p in pieces]
    chunks[-1]["finish_reason"] = "stop"
    return list(reader.stream(iter(chunks)))


@pytest.mark.parametrize("reader,text", [
    (R1, "Let me see: 2 < 3.\n</think>\n\nIt is </thin 4."), (R1, "<think>a</think>b"), (R1, "never done <"),
    (QWEN3, "<think>\nhmm, 2 < 3</think>\n\nIt is 4."), (QWEN3, "It is <think> 4."), (QWEN3, "<thin"),
    (QWEN3, "  <think></think>x")])
def test_streams_cut_anywhere_agree_with_the_whole(reader, text):
    rng = random.Random(0)
    reasoning, answer = reader.parts(text)
    for cuts in [[i] for i in range(1, len(text))] + [sorted(rng.sample(range(1, len(text)), 4)) for _ in range(20)]:
        out = stream(reader, text, cuts)
        got_reasoning = "".join(c["delta"].get("reasoning_content", "") for c in out)
        got_answer = "".join(c["delta"].get("content", "") for c in out)
        assert (got_reasoning, got_answer) == (reasoning or "", answer), cuts
        assert out[-1]["finish_reason"] == "stop"


@pytest.mark.parametrize("parser,prompt,begun,waits", [
    ("deepseek_r1", "<|User|>2+2?<|Assistant|>", True, True),           # thinking starts in the prompt
    ("deepseek_r1", "<|User|>2+2?<|Assistant|><think>\n", True, True),   # R1-0528's template writes the tag
    ("deepseek_r1", "<|Assistant|><think>\n\n</think>\n\n", False, False),   # thinking turned off
    ("qwen3", "<|im_start|>assistant\n", False, True),                  # the model may think, or not
    ("qwen3", "<|im_start|>assistant\n<think>\n", True, True),         # Qwen3 thinking-2507
    ("qwen3", "<think>\nold</think>\nhi<|im_start|>assistant\n<think>\n\n</think>\n\n", False, False),
])
def test_the_prompt_says_whether_thinking_has_begun_or_ended(parser, prompt, begun, waits):
    """Thinking begun in the prompt is read from the first token; otherwise a text that begins with
    <think> still reasons. A grammar waits for </think> (StructuredOutput.after) unless the prompt
    has ended the thinking."""
    reader = reasoning_reader(parser, prompt)
    assert reader.starts_in_prompt == begun and reader.grammar_after == ("</think>" if waits else "")
    assert reader.parts("x</think>y") == (("x", "y") if begun else (None, "x</think>y"))
    assert reader.parts("<think>x</think>y") == ("x", "y")
    assert reasoning_reader(None, prompt) is None
