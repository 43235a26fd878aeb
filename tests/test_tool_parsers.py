"""The tool-call parsers of tool_choice "auto" (jaxserve/server/tool_parsers.py) on the formats
their models' chat templates ask for; served end to end in tests/test_server.py."""
import pytest

from jaxserve.server.tool_parsers import Forced, Hermes, Llama3Json

ADD = ("add", {"a": 1, "b": [2, 3]})


@pytest.mark.parametrize("parser,text,content,calls", [
    (Hermes(), 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}\n</tool_call>',
     "Let me add.\n", [ADD]),
    (Hermes(), '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}</tool_call>\n'
               '<tool_call>{"name": "now"}</tool_call>', "", [ADD, ("now", {})]),
    (Hermes(), '<tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}', "", [ADD]),   # eos before the end tag
    (Hermes(), "No tools needed: 4.", "No tools needed: 4.", None),
    (Hermes(), 'Here: <tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', None, None),   # cut short
    (Hermes(), "2 < 3, <tool", None, None),
    (Llama3Json(), '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}', "", [ADD]),
    (Llama3Json(), '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}; {"name": "now", '
                   '"parameters": {}}', "", [ADD, ("now", {})]),
    (Llama3Json(), ' {"name": "add", "arguments": {"a": 1, "b": [2, 3]}}', "", [ADD]),
    (Llama3Json(), "The answer is {4}.", "The answer is {4}.", None),
    (Llama3Json(), '{"answer": 4}', None, None),
    (Forced(None), '[{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}]', "", [ADD]),
    (Forced("add"), '{"a": 1, "b": [2, 3]}', "", [ADD]),
    (Forced(None), '{"name": "add"}', None, None),
])
def test_calls_and_the_text_before_them(parser, text, content, calls):
    begins = parser.begins(text)
    assert parser.calls(text[begins:]) == calls
    if calls is not None:
        assert text[:begins] == content


@pytest.mark.parametrize("parser,text,sendable", [
    (Hermes(), "Hi", 2), (Hermes(), "Hi <", 3), (Hermes(), "Hi <tool_", 3), (Hermes(), "Hi <tool_call>{", 3),
    (Hermes(), "Hi <b>", 6), (Hermes(), "", 0),
    (Llama3Json(), "", 0), (Llama3Json(), " ", 0), (Llama3Json(), "<|py", 0), (Llama3Json(), '{"na', 0),
    (Llama3Json(), "Hello", 5), (Llama3Json(), "<b>", 3),
    (Forced(None), "[{", 0)])
def test_a_stream_holds_back_what_may_become_a_call(parser, text, sendable):
    """A stream sends a choice's text up to `begins`: never a marker's first characters, which a
    later chunk may complete; all of a text that cannot become a call."""
    assert parser.begins(text) == sendable
