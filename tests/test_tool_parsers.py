"""The tool-call parsers of tool_choice "auto" (jaxserve/server/tool_parsers.py) on the formats
their models' chat templates ask for; served end to end in tests/test_server.py."""
import re

import pytest

from jaxserve.server.tool_parsers import Forced, Hermes, Llama3Json, Mistral, Pythonic
from jaxserve.server.tools import tool_calls
from jaxserve.server.validation import sampling_params

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
    (Mistral(), '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}, {"name": "now", "arguments": {}}]',
     "", [ADD, ("now", {})]),
    (Mistral(), 'Adding.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}]', "Adding.", [ADD]),
    (Mistral(), '[TOOL_CALLS]add[ARGS]{"a": 1, "b": [2, 3]}[TOOL_CALLS]now[ARGS]{}', "", [ADD, ("now", {})]),
    (Mistral(), '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1', None, None),   # cut short
    (Mistral(), '[TOOL_CALLS]add[ARGS][1, 2]', None, None),   # arguments not an object
    (Mistral(), "It is [4].", "It is [4].", None),
    (Pythonic(), "[add(a=1, b=[2, 3])]", "", [ADD]),
    (Pythonic(), ' [add(a=1, b=[2, 3]), now()]\n', "", [ADD, ("now", {})]),
    (Pythonic(), "<|python_start|>[add(a=1, b=[2, 3])]<|python_end|>", "", [ADD]),
    (Pythonic(), "[add(a=1, b=[2, 3]), now(]", None, None),   # cut short
    (Pythonic(), "[add(1, 2)]", None, None),                  # positional arguments
    (Pythonic(), "[add(a=os.getcwd())]", None, None),         # not a literal: never evaluated
    (Pythonic(), "[add(**kw)]", None, None),
    (Pythonic(), "[1, 2]", None, None),
    (Pythonic(), "The answer is [4].", "The answer is [4].", None),
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
    (Pythonic(), "", 0), (Pythonic(), " [ad", 0), (Pythonic(), "<|py", 0), (Pythonic(), "Hi", 2),
    (Mistral(), "Hi [TOOL", 3), (Mistral(), "Hi [4]", 6), (Mistral(), "[TOOL_CALLS]", 0),
    (Forced(None), "[{", 0)])
def test_a_stream_holds_back_what_may_become_a_call(parser, text, sendable):
    """A stream sends a choice's text up to `begins`: never a marker's first characters, which a
    later chunk may complete; all of a text that cannot become a call."""
    assert parser.begins(text) == sendable


def test_mistral_calls_get_the_ids_its_templates_accept():
    """Mistral's chat templates refuse a returned call whose id is not 9 letters and digits; its
    syntax starts with a special token, so the server keeps special tokens in the text it reads."""
    body = {"tools": [{"type": "function", "function": {"name": "add"}}]}
    mistral, hermes = tool_calls(body, "mistral"), tool_calls(body, "hermes")
    assert mistral.parser.keeps_special_tokens and not hermes.parser.keeps_special_tokens
    content, calls = mistral.split('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "add"}]')
    assert content == "" and [c["function"]["name"] for c in calls] == ["add", "add"]
    assert all(re.fullmatch("[A-Za-z0-9]{9}", c["id"]) for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert hermes.split('<tool_call>{"name": "add"}</tool_call>')[1][0]["id"].startswith("call_")
    for keep, skip in ((True, False), (False, True)):   # as the chat route passes the parser's flag
        assert sampling_params({**body, "skip_special_tokens": True}, chat=True, max_tokens=None,
                               keep_special_tokens=keep).skip_special_tokens is skip
