"""Structured output and tool calls through the real server and the openai SDK: a pydantic model
with `beta.chat.completions.parse`, json_object, guided fields and grammars, streamed JSON, forced
tool calls streamed and not, and the 400s of bad constraints. Engine-level checks:
tests/test_structured_output.py. The server runs with --return-tokens-as-token-ids (the flag's
test is here: none of the others reads a logprob's token)."""
import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest
import requests

from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.tokenizer import load_tokenizer
from tests.server_harness import TEST_ENGINE, openai_client, serving
from tests.structured_cases import AGE, CHOICES, POINT, REGEX, TAGS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("server"), TINY_MODEL_DIR, "--served-model-name", "jaxserve-tiny",
                       "--return-tokens-as-token-ids", **{**TEST_ENGINE, "max_model_len": 256})


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0, le=10_000_000)
    country: Literal["France", "Japan", "Peru"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_openai_parse_with_a_pydantic_model(server, client):
    before = server.metrics()["jaxserve_xla_compilations_total"]
    r = client.beta.chat.completions.parse(model="jaxserve-tiny", messages=USER, response_format=City,
                                           max_tokens=64, temperature=0.7, seed=3, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City)
        assert City.model_validate_json(choice.message.content) == choice.message.parsed
    assert server.metrics()["jaxserve_xla_compilations_total"] == before


def test_the_server_names_tokens_by_id_unless_a_request_says_not(server):
    """--return-tokens-as-token-ids: logprobs' tokens are "token_id:ID" (the ids the request's
    return_token_ids lists, the tokenizer's texts with return_tokens_as_token_ids false)."""
    tok = load_tokenizer(TINY_MODEL_DIR)

    def logprobs(**extra):
        r = requests.post(server.url + "/v1/completions", json={
            "prompt": "Data:", "max_tokens": 4, "temperature": 0, "logprobs": 1, "return_token_ids": True, **extra},
            timeout=120)
        assert r.status_code == 200, r.text
        [c] = r.json()["choices"]
        return c["logprobs"]["tokens"], c["token_ids"]
    tokens, ids = logprobs()
    assert tokens == [f"token_id:{t}" for t in ids] and len(ids) == 4
    tokens, same = logprobs(return_tokens_as_token_ids=False)
    assert same == ids and "".join(tokens) == tok.decode(ids)


def test_json_object_and_guided_fields_on_completions(server):
    def complete(**extra):
        r = requests.post(server.url + "/v1/completions", json={"prompt": "Data:", "max_tokens": 64,
                                                                 "temperature": 0, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"]
    # Any object: the tiny model writes long keys, so a bias makes it close at once, and the mask
    # comes first: "a" (biased higher, but not JSON after "{") is never sampled.
    vocab = load_tokenizer(TINY_MODEL_DIR).tk
    bias = {str(vocab.token_to_id("a")): 100, str(vocab.token_to_id("}")): 50}
    [c] = complete(response_format={"type": "json_object"}, logit_bias=bias)
    assert c["finish_reason"] == "stop" and json.loads(c["text"]) == {}
    [c] = complete(guided_json=json.dumps(POINT))
    jsonschema.validate(json.loads(c["text"]), POINT)
    choices = complete(guided_regex=REGEX, n=2, temperature=1.0, seed=5)
    assert all(re.fullmatch(REGEX, c["text"]) for c in choices)
    [c] = complete(guided_choice=list(CHOICES))
    assert c["text"] in CHOICES
    # Grammars (guided_grammar, vLLM's structured_outputs): GBNF, and Lark with recursion (nested
    # lists: no regex can say it), each output checked by a parser of its own.
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'
    [c] = complete(structured_outputs={"grammar": gbnf})
    assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", c["text"]) and c["finish_reason"] == "stop", c
    [c] = complete(guided_grammar='start: list\nlist: "[" (list ("," list)*)? "]"')

    def nested_lists(v):
        return isinstance(v, list) and all(nested_lists(x) for x in v)
    assert nested_lists(json.loads(c["text"])) and c["finish_reason"] == "stop", c
    for so, check in [({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)), ({"choice": list(CHOICES)}, CHOICES.__contains__),
                      ({"json": POINT}, lambda t: jsonschema.validate(json.loads(t), POINT) is None)]:
        [c] = complete(structured_outputs=so)
        assert check(c["text"]), (so, c)


def test_streamed_json_schema(client):
    schema = {"type": "object", "properties": {"x": AGE, "tags": TAGS}, "required": ["x", "tags"]}
    stream = client.chat.completions.create(
        model="jaxserve-tiny", messages=USER, max_tokens=64, temperature=0.9, seed=1, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}})
    texts, finish = {}, {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert sorted(texts) == [0, 1] and set(finish.values()) == {"stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


def check_calls(calls, names):
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    for c in calls:
        tool = {"get_weather": WEATHER, "search": SEARCH}[c.function.name]
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), tool["function"]["parameters"])


def test_tool_calls(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="jaxserve-tiny", messages=USER, tools=[WEATHER, SEARCH],
                                       tool_choice=named, max_tokens=64, temperature=0)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, {"get_weather"})
    r = client.chat.completions.create(model="jaxserve-tiny", messages=USER, tools=[WEATHER, SEARCH],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=96,
                                       temperature=0.8, seed=2, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, {"get_weather", "search"})
    r = client.chat.completions.create(model="jaxserve-tiny", messages=USER, tools=[WEATHER], tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(model="jaxserve-tiny", messages=USER, tools=[WEATHER, SEARCH],
                                            tool_choice="required", max_tokens=96, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            assert not c.delta.content
            for call in c.delta.tool_calls or []:
                calls[call.index] = call
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    check_calls([calls[k] for k in sorted(calls)], {"get_weather", "search"})


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "GBNF"),
    ({"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
    ({"structured_outputs": {"grammar": 5}}, "structured_outputs", "as a string"),
    ({"tools": [WEATHER]}, "tool_choice", "'auto' needs a server started with --enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
]


@pytest.mark.parametrize("extra,param,words", BAD, ids=[b[1] + "-" + str(i) for i, b in enumerate(BAD)])
def test_bad_requests_are_400(server, extra, param, words):
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **extra},
                      timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
