"""/v1/responses end to end, through the official `openai` client's Responses API (its stream
helper checks the events' order and accumulates them) on the server of tests/test_server.py
(hermes tool calls, qwen3 reasoning): each answer equals the chat completion the same request
makes on /v1/chat/completions, which test_server.py checks against transformers."""
import json
import re
import typing

import jsonschema
import pydantic
import pytest
import requests

from tests.hostile_requests import NAME
from tests.server_harness import openai_client
from tests.test_server import NO_THINKING, model, server  # noqa: F401  (the module's fixtures)

BRIEF = dict(model=NAME, temperature=0, max_output_tokens=12)
# Bounded arguments and answers: the random model would write digits until max_output_tokens.
TOOLS = [{"type": "function", "name": "add", "description": "Adds two numbers", "parameters": {
    "type": "object", "properties": {"a": {"enum": [1, 2, 3]}, "b": {"type": "boolean"}}, "required": ["a", "b"],
    "additionalProperties": False}}]


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return openai_client(server)


def chat(client, messages, **extra):
    [c] = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_tokens=12,
                                         extra_body=extra).choices
    return c


def test_text_and_usage_are_the_chat_completions(client):
    r = client.responses.create(input="The quick brown fox", instructions="Answer briefly.",
                                extra_body={"ignore_eos": True}, **BRIEF)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "The quick brown fox"}]
    c = chat(client, messages, ignore_eos=True)
    assert r.output_text == c.message.content and r.output_text
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")   # cut at 12 tokens
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.id.startswith("resp_") and r.model == NAME and r.instructions == "Answer briefly."
    usage = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12,
                                           extra_body={"ignore_eos": True}).usage
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (usage.prompt_tokens, 12, usage.prompt_tokens + 12)
    # input as message items with text parts, a developer message among them
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The quick brown fox"}]}]
    assert client.responses.create(input=items, extra_body={"ignore_eos": True}, **BRIEF).output_text == r.output_text


def test_streamed_events_make_the_same_response(client):
    kw = dict(input="Once upon a time", extra_body={"ignore_eos": True}, **BRIEF)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    # The client's own accumulation of the events (of a response that completes: its helper
    # wants `response.completed`).
    kw = dict(BRIEF, input="Once upon a time", max_output_tokens=40,
              extra_body={"guided_regex": "[a-z ]{20}", **NO_THINKING})
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    whole = client.responses.create(**kw)
    assert final.status == whole.status == "completed" and final.output_text == whole.output_text
    assert re.fullmatch("[a-z ]{20}", whole.output_text) and final.usage.output_tokens == whole.usage.output_tokens


def test_logprobs_are_the_chat_completions(client):
    """include=["message.output_text.logprobs"] with top_logprobs: the output_text's logprobs are
    the chat completion's of the same request (test_server.py checks those against
    transformers), whole and streamed (each delta's own, the done event's all of them)."""
    kw = dict(input="Once upon a time", include=["message.output_text.logprobs"], top_logprobs=3,
              extra_body={"ignore_eos": True, **NO_THINKING}, **BRIEF)
    r = client.responses.create(**kw)
    c = chat(client, [{"role": "user", "content": "Once upon a time"}], ignore_eos=True, logprobs=True,
             top_logprobs=3, **NO_THINKING)
    expected = [e.model_dump() for e in c.logprobs.content]
    assert len(expected) == 12 and all(len(e["top_logprobs"]) == 3 for e in expected)
    assert [e.model_dump() for e in r.output[0].content[0].logprobs] == expected
    assert r.output_text == c.message.content
    events = list(client.responses.create(stream=True, **kw))
    streamed = [e.model_dump() for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    [done] = [ev for ev in events if ev.type == "response.output_text.done"]
    assert streamed == [e.model_dump() for e in done.logprobs] == expected
    # without them: none, as before
    assert client.responses.create(**{**kw, "include": [], "top_logprobs": None}).output[0].content[0].logprobs == []


class Point(pydantic.BaseModel):
    x: typing.Literal[1, 2, 3]
    y: bool


def test_text_format_json_schema_through_the_parse_helper(client):
    r = client.responses.parse(model=NAME, input="A point:", text_format=Point, temperature=0,
                               max_output_tokens=60, extra_body=NO_THINKING)
    assert isinstance(r.output_parsed, Point), r.output_text
    schema = {"type": "object", "properties": {"n": {"enum": ["one", "two"]}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=NAME, input="A number:", temperature=0, max_output_tokens=40,
                                extra_body=NO_THINKING,
                                text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_function_calls_out_and_their_outputs_back(client):
    kw = dict(model=NAME, input="1 + 2?", tools=TOOLS, tool_choice={"type": "function", "name": "add"},
              temperature=0, max_output_tokens=60, extra_body=NO_THINKING)
    r = client.responses.create(**kw)
    [call] = r.output
    assert (call.type, call.name, call.status) == ("function_call", "add", "completed") and call.call_id
    args = json.loads(call.arguments)
    jsonschema.validate(args, TOOLS[0]["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == args
    assert events[-1].type == "response.completed" and events[-1].response.output[0].name == "add"
    # the call and its output sent back, as the client's next turn does
    turn = [{"role": "user", "content": "1 + 2?"},
            {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    r = client.responses.create(model=NAME, input=turn, tools=TOOLS, temperature=0, max_output_tokens=12,
                                extra_body={"ignore_eos": True, **NO_THINKING})
    c = chat(client, [{"role": "user", "content": "1 + 2?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                       "function": {"name": "add", "arguments": call.arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "3"}],
             tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}],
             ignore_eos=True, **NO_THINKING)
    assert r.output_text == c.message.content


def test_reasoning_is_an_item_of_its_own(client):
    kw = dict(model=NAME, input="1 + 2?", temperature=0, max_output_tokens=60,
              extra_body={"guided_regex": r"<think>[a-z]{5}</think>It is 3\.", **NO_THINKING})
    r = client.responses.create(**kw)
    assert [item.type for item in r.output] == ["reasoning", "message"] and r.status == "completed"
    thought = r.output[0].content[0].text
    assert re.fullmatch("[a-z]{5}", thought) and r.output_text == "It is 3."
    events = list(client.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]


def test_reasoning_effort_reaches_the_template(client):
    """reasoning.effort is chat's reasoning_effort: the same prompt, which the template's
    "Reasoning: low" line makes longer than without."""
    r = client.responses.create(input="hi", reasoning={"effort": "low"}, **BRIEF)
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       reasoning_effort="low")
    plain = client.responses.create(input="hi", **BRIEF)
    assert r.usage.input_tokens == c.usage.prompt_tokens == plain.usage.input_tokens + len("Reasoning: low\n")
    assert r.reasoning.effort == "low"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "hi", "include": "message.output_text.logprobs"}, "include"),
    ({"input": "hi", "max_output_tokens": -1}, "max_tokens"),
    ({"input": "hi", "text": {"format": "json"}}, "format"),
    ({"input": "hi", "reasoning": "low"}, "reasoning"),
    ({"input": "hi", "reasoning": {"effort": "max"}}, "reasoning_effort"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param):  # noqa: F811
    r = requests.post(server.url + "/v1/responses", json={"model": NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_unknown_model_is_a_404(server):  # noqa: F811
    r = requests.post(server.url + "/v1/responses", json={"model": "gpt-5", "input": "hi"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
