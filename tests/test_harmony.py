"""gpt-oss's harmony messages (jaxserve/server/harmony.py) read by the `openai_gptoss` reasoning
parser and the `openai` tool parser, on texts written by the format's rules (OpenAI's harmony
guide): whole texts, and streams cut anywhere agreeing with them through both readers as the
chat route chains them."""
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import yaml
from transformers import AutoTokenizer

from jaxserve import cli
from jaxserve.server.reasoning import reasoning_reader
from jaxserve.server.tool_parsers import OpenAI
from jaxserve.server.tools import ToolCalls, tool_calls
from tests.server_harness import BYTES_ENGINE, TEST_ENGINE, bytes_model_dir, store_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


@pytest.mark.parametrize("architecture, flags, parser", [
    ("GptOssForCausalLM", [], "openai_gptoss"),
    ("LlamaForCausalLM", ["--enable-auto-tool-choice", "--tool-call-parser", "openai"], "openai_gptoss"),
    ("GptOssForCausalLM", ["--reasoning-parser", "qwen3"], "qwen3"),   # a parser named stays
    ("LlamaForCausalLM", ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], None),
    ("NoSuchForCausalLM", [], None),
])
def test_harmony_text_is_read_as_harmony_without_a_reasoning_parser(tmp_path, architecture, flags, parser):
    """`jaxserve serve` of a gpt-oss model, or with the `openai` tool parser, reads harmony
    messages with no --reasoning-parser: the answer apart, not the raw text with its tokens."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    args = cli.build_parser().parse_args(["serve", "--model", str(tmp_path), *flags])
    options = cli._app_options(args, cli.engine_config(args))
    assert options["reasoning_parser"] == parser
    if parser == "openai_gptoss":
        text = THINK + "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
        assert reasoning_reader(parser, "").parts(text) == ("User asks 2+2. Simple.", "It is 4.")


def test_the_format_is_read_with_special_tokens_kept_and_the_grammar_waits_for_the_answer():
    assert HARMONY.keeps_special_tokens and OpenAI.keeps_special_tokens
    assert HARMONY.grammar_after == "<|channel|>final<|message|>"
    assert isinstance(tool_calls({"tools": [{"type": "function", "function": {"name": "f"}}]}, "openai"), ToolCalls)


def tool(name: str, cities: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": cities}}, "required": ["city"]}}}


def test_forced_tool_choice_writes_a_harmony_call(tmp_path_factory):
    """A forced tool_choice on a harmony prompt (a chat template written by the format's rules,
    ending `<|start|>assistant`, on the API tests' byte-level model, through run-batch and the
    chat route with --reasoning-parser openai_gptoss --tool-call-parser openai): a named function
    gets its call header (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`)
    after the prompt and its arguments from the first token, "required" the final channel and the
    list of calls; both answered as that call. (Before, the grammar waited for a final channel
    the model never wrote: the output was free text, no call.)"""
    work = tmp_path_factory.mktemp("harmony_forced")
    model = str(work / "model")
    shutil.copytree(bytes_model_dir(tmp_path_factory), model)
    with open(os.path.join(model, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                               "{% endfor %}<|start|>assistant")
    with open(os.path.join(model, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    settings = {**TEST_ENGINE, **BYTES_ENGINE}
    (work / "engine.yaml").write_text(yaml.safe_dump({**settings, "compilation_cache_dir": store_of(settings)}))
    tools = [tool("get_weather", ["Paris", "Rome"]), tool("get_time", ["Oslo", "Lima"])]
    chat = {"model": "bytes", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
            "max_tokens": 64, "temperature": 0, "return_token_ids": True}
    bodies = {"named": {**chat, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
              "required": {**chat, "tool_choice": "required", "parallel_tool_calls": False}}
    lines = [json.dumps({"custom_id": k, "url": "/v1/chat/completions", "body": b}) for k, b in bodies.items()]
    (work / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "run-batch", "--model", model,
                           "--config", str(work / "engine.yaml"), "--served-model-name", "bytes",
                           "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
                           "--tool-call-parser", "openai", "-i", str(work / "in.jsonl"), "-o", str(work / "out.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, (work / "out.jsonl").read_text().splitlines())}
    tok = AutoTokenizer.from_pretrained(model)
    prompt = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
    for kind, begun in (("named", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"),
                        ("required", "<|channel|>final<|message|>")):
        [choice] = out[kind]["choices"]
        assert out[kind]["prompt_token_ids"] == tok.encode(prompt + begun, add_special_tokens=False), kind
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, kind
        [call] = choice["message"]["tool_calls"]
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name == "get_time" if kind == "named" else name in ("get_weather", "get_time"), kind
        assert arguments["city"] in tools[name == "get_time"]["function"]["parameters"]["properties"]["city"]["enum"]
