"""The HTTP server, end to end: one real server (subprocess) for the module, driven by the
official `openai` client and raw HTTP. Generated text is checked against a greedy loop over the
same checkpoint in Hugging Face transformers."""
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
import requests

from tests.hf_models import hf_greedy
from tests.hostile_requests import C, HOSTILE, LONG, MAX_LEN, NAME, OK, send
from tests.server_harness import BYTES_ENGINE, bytes_model, openai_client, serving
README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bytes_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("server"), model[0], "--served-model-name", NAME,
                       "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
                       **BYTES_ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=120, **kw)


def sse_events(response) -> list[dict]:
    lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    assert all(line.startswith(b"data: ") for line in lines)
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- the openai client ----

def test_completions_match_transformers(server, client, model):
    _, hf, tok = model
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    ref, ref_lps = hf_greedy(hf, prompt, 12)
    kw = dict(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(logprobs=2, **kw)
    c = out.choices[0]
    assert c.text == tok.decode(ref)
    assert c.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 12)
    assert c.logprobs.token_logprobs == pytest.approx(ref_lps, abs=1e-3)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(lp, abs=1e-6)
               for top, lp in zip(c.logprobs.top_logprobs, c.logprobs.token_logprobs))

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == len(prompt) + 12
    assert all(ch.usage is None for ch in chunks[:-1])

    # A string prompt is tokenized by the server as by the model's tokenizer.
    text = client.completions.create(model=NAME, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert text == c.text


def test_chat_matches_transformers(server, client, model):
    _, hf, tok = model
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld ✓"}]
    # tests/hf_models.py's chat template, written out
    prompt = tok.encode("system: Be brief.\nuser: héllo wörld ✓\nassistant:", add_special_tokens=False)
    ref, ref_lps = hf_greedy(hf, prompt, 10)
    kw = dict(model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    out = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    c = out.choices[0]
    assert c.message.role == "assistant" and c.message.content == tok.decode(ref)
    assert c.finish_reason == "length" and out.object == "chat.completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 10)
    assert [e.logprob for e in c.logprobs.content] == pytest.approx(ref_lps, abs=1e-3)
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
               for e in c.logprobs.content)
    # `bytes`: each token's own byte (this tokenizer's tokens are one byte each, or special), so
    # that pieces of a character join up, which the tokens' texts (U+FFFD) cannot
    assert all(len(e.bytes) == 1 for e in c.logprobs.content)
    assert bytes(b for e in c.logprobs.content for b in e.bytes).decode(errors="replace") == c.message.content

    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_several_prompts_and_choices(server):
    """Two prompts x n=2, seeded: four choices, the same whether streamed or not."""
    body = dict(model=NAME, prompt=["ab", "cd"], n=2, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    full = post(server, "/v1/completions", body).json()
    assert [c["index"] for c in full["choices"]] == [0, 1, 2, 3]
    assert full["usage"] == {"prompt_tokens": 4, "completion_tokens": 24, "total_tokens": 28,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    texts = {c["index"]: "" for c in full["choices"]}
    for event in sse_events(post(server, "/v1/completions", {**body, "stream": True}, stream=True)):
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}
    assert post(server, "/v1/completions", body).json()["choices"] == full["choices"]   # seeded


def test_models_health_tokenize(server, client, model):
    tok = model[2]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert requests.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    r = post(server, "/tokenize", {"prompt": "héllo ✓"}).json()
    assert r["tokens"] == tok.encode("héllo ✓") and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "héllo ✓"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.encode("user: hi\nassistant:", add_special_tokens=False)


def test_chat_tool_turns_and_template_options(server, model):
    """A tool-call round trip as OpenAI clients send it (the assistant's tool_calls with null
    content and arguments as JSON text, then the tool's answer), text parts, the tools and
    chat_template_kwargs: rendered as transformers renders the same conversation with arguments
    as objects and parts joined by newlines (as vLLM passes them). Then continue_final_message."""
    tok = model[2]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    sent = [{"role": "user", "content": [{"type": "text", "text": "add"}, {"type": "text", "text": "1 and 2"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    rendered = [{"role": "user", "content": "add\n1 and 2"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
                {"role": "tool", "content": "3", "tool_call_id": "call_1"}]

    def expected(msgs, **kw):
        return tok.encode(tok.apply_chat_template(msgs, tokenize=False, **kw), add_special_tokens=False)

    body = {"messages": sent, "tools": tools, "chat_template_kwargs": {"note": "be exact"}}
    tokens = post(server, "/tokenize", body).json()["tokens"]
    assert tokens == expected(rendered, tools=tools, note="be exact", add_generation_prompt=True)
    assert '"arguments": {"a": 1, "b": 2}' in tok.decode(tokens)
    r = post(server, "/v1/chat/completions", {**body, "model": NAME, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(tokens)

    # OpenAI's reasoning_effort is the template's variable, as chat_template_kwargs' would be
    effort = post(server, "/tokenize", {"messages": sent[:1], "reasoning_effort": "low"}).json()["tokens"]
    assert effort == expected(rendered[:1], reasoning_effort="low", add_generation_prompt=True)
    assert tok.decode(effort).startswith("Reasoning: low\n")
    r = openai_client(server).chat.completions.create(model=NAME, messages=sent[:1], max_tokens=2,
                                                      reasoning_effort="low")
    assert r.usage.prompt_tokens == len(effort)

    partial = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    tokens = post(server, "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()["tokens"]
    assert tokens == expected(partial, add_generation_prompt=False, continue_final_message=True)
    assert tok.decode(tokens).endswith("assistant: Hel")


# The server reads reasoning (qwen3), so a grammar waits for </think> unless the prompt ended the
# thinking, as Qwen3's template does with thinking turned off.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_auto_tool_choice_reads_hermes_calls(client):
    """--enable-auto-tool-choice --tool-call-parser hermes: with tool_choice "auto" (the default
    with tools) the calls the model writes in Qwen's syntax (forced here by a regex) come back as
    tool_calls, after the text before them; streamed, that text comes as it is written and no byte
    of the call does. A text that only looks like the start of a call stays text."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    kw = dict(model=NAME, messages=[{"role": "user", "content": "1 + 2?"}], tools=tools, temperature=0, max_tokens=200)

    def streamed(regex):
        chunks = [ch.choices[0] for ch in client.chat.completions.create(
            stream=True, extra_body={"guided_regex": regex, **NO_THINKING}, **kw) if ch.choices]
        return ("".join(c.delta.content or "" for c in chunks), [t for c in chunks for t in c.delta.tool_calls or []],
                chunks[-1].finish_reason)

    for content in ("Sure. ", ""):
        [c] = client.chat.completions.create(extra_body={"guided_regex": re.escape(content + call * 2), **NO_THINKING},
                                             **kw).choices
        assert c.finish_reason == "tool_calls" and c.message.content == (content or None)
        assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
            [("add", {"a": 1, "b": 2})] * 2
        text, calls, finish = streamed(re.escape(content + call * 2))
        assert (text, finish) == (content, "tool_calls") and [t.index for t in calls] == [0, 1]
        assert [json.loads(t.function.arguments) for t in calls] == [{"a": 1, "b": 2}] * 2
    [c] = client.chat.completions.create(extra_body={"guided_regex": "Sure, <tool", **NO_THINKING}, **kw).choices
    assert (c.message.content, c.message.tool_calls, c.finish_reason) == ("Sure, <tool", None, "stop")
    assert streamed("Sure, <tool") == ("Sure, <tool", [], "stop")


def test_reasoning_parser_sets_the_thinking_apart(client):
    """--reasoning-parser qwen3: an answer that thinks first (spelt out here by a regex, with the
    template's thinking turned off so that the grammar applies at once) has its <think> block as
    reasoning_content and the rest as content, streamed and not; after it, a hermes call is read
    from the answer. (Answers that do not think: every other chat test.)"""
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    kw = dict(model=NAME, messages=[{"role": "user", "content": "1 + 2?"}], temperature=0, max_tokens=120,
              extra_body={"guided_regex": r"<think>[a-z]{5}</think>It is 3\.", **NO_THINKING})
    [c] = client.chat.completions.create(**kw).choices
    thought = c.message.model_extra["reasoning_content"]
    assert re.fullmatch("[a-z]{5}", thought) and c.message.content == "It is 3."
    chunks = [ch.choices[0].delta for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in chunks) == thought
    assert "".join(d.content or "" for d in chunks) == "It is 3."
    kw["extra_body"] = {"guided_regex": r"<think>[a-z]{5}</think>Sure\. " + re.escape(call), **NO_THINKING}
    [c] = client.chat.completions.create(tools=tools, **kw).choices
    assert re.fullmatch("[a-z]{5}", c.message.model_extra["reasoning_content"]) and c.message.content == "Sure. "
    assert [t.function.name for t in c.message.tool_calls] == ["add"] and c.finish_reason == "tool_calls"


def test_a_grammar_waits_for_the_end_of_thinking(client):
    """A prompt that has begun thinking (its last tag <think>, here continued from the assistant's
    message) is read as reasoning from the first token, and a grammar waits for </think>; so it
    does after a prompt with no tag, where qwen3 lets the model think or not (as vLLM). This random
    model never writes </think>, so both outputs are the free ones. A prompt that has ended the
    thinking (the template's thinking turned off) gets the grammar at once."""
    def chat(thought, **extra):
        msgs = [{"role": "user", "content": "1 + 2?"}] + ([{"role": "assistant", "content": thought}] if thought else [])
        [c] = client.chat.completions.create(model=NAME, messages=msgs, temperature=0, max_tokens=12, extra_body={
            "add_generation_prompt": not thought, "continue_final_message": bool(thought), "ignore_eos": True,
            **extra}).choices
        return c.message.model_extra.get("reasoning_content"), c.message.content, c.finish_reason
    begun, untagged = chat("<think>"), chat(None)
    assert begun[0] and begun[1] is None and begun[2] == "length"
    assert untagged[0] is None and untagged[1] and untagged[2] == "length"
    assert chat("<think>", guided_regex="[0-9]{3}") == begun and chat(None, guided_regex="[0-9]{3}") == untagged
    for ended in (chat("<think>hm</think>", guided_regex="[0-9]{3}"), chat(None, guided_regex="[0-9]{3}", **NO_THINKING)):
        assert ended[0] is None and re.fullmatch("[0-9]{3}", ended[1]) and ended[2] == "stop", ended


# ---- hostile input: a 4xx with an error body, never a 500, and the server stays up ----

@pytest.mark.parametrize("method,path,body,headers,status", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_request(server, method, path, body, headers, status):
    r = send(server.url, method, path, body, headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_error_messages_name_the_problem(server):
    err = post(server, C, {**OK, "prompt": LONG, "max_tokens": 7}).json()["error"]["message"]
    assert str(MAX_LEN) in err and str(len(LONG)) in err and "7" in err
    err = post(server, C, {**OK, "temperature": 3}).json()["error"]
    assert err["param"] == "temperature" and "temperature" in err["message"]
    assert post(server, C, {**OK, "max_tokens": "2"}).json()["error"]["param"] == "max_tokens"


def test_healthy_after_hostile_requests(server):
    for _, method, path, body, headers, _ in HOSTILE[:12]:   # the raw-bytes ones, again
        send(server.url, method, path, body, headers)
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    r = post(server, C, OK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    m = server.metrics()
    assert m["jaxserve_num_sequences_running"] == 0 and m["jaxserve_kv_cache_usage_ratio"] == 0


# ---- load, disconnects, streaming ----

def test_64_concurrent_streams_match_solo(server):
    prompts = [f"request {i}: {'ab' * (i % 5)}" for i in range(64)]

    def body(p, stream):
        return dict(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=stream)

    solo = [post(server, C, body(p, False)).json()["choices"][0] for p in prompts]

    def streamed(p):
        events = sse_events(post(server, C, body(p, True), stream=True))
        return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        together = list(pool.map(streamed, prompts))
    assert together == [(c["text"], c["finish_reason"]) for c in solo]
    m = server.metrics()
    assert (m["jaxserve_num_sequences_running"], m["jaxserve_num_sequences_waiting"],
            m["jaxserve_kv_cache_usage_ratio"]) == (0, 0, 0)


def test_disconnect_frees_pages_within_a_second(server):
    before = server.metrics()["jaxserve_generation_tokens_total"]
    r = post(server, C, {**OK, "max_tokens": 2000, "ignore_eos": True, "stream": True}, stream=True)
    lines = r.iter_lines()
    for _ in range(3):
        assert next(lines).startswith(b"data: ")
        next(lines)
    assert server.metrics()["jaxserve_kv_cache_usage_ratio"] > 0
    r.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        m = server.metrics()
        if m["jaxserve_kv_cache_usage_ratio"] == 0 and m["jaxserve_num_sequences_running"] == 0:
            break
        time.sleep(0.02)
    assert m["jaxserve_kv_cache_usage_ratio"] == 0 and m["jaxserve_num_sequences_running"] == 0
    assert m["jaxserve_generation_tokens_total"] - before < 2000   # aborted, not run to the end


def test_non_streaming_clients_that_leave_are_aborted(server):
    """24 non-streaming requests (8 run, 16 wait) whose clients hang up at once: every one is
    aborted, running or queued, instead of generating its 2000 tokens for nobody."""
    before = server.metrics()["jaxserve_generation_tokens_total"]
    aborted_before = server.log_tail(10**6).count("aborted (client gone")
    body = json.dumps({**OK, "max_tokens": 2000, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    socks = []
    for _ in range(24):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        socks.append(sock)
    t0 = time.monotonic()   # all 24 in the engine (running or queued) before they hang up
    while time.monotonic() - t0 < 30:
        m = server.metrics()
        if m["jaxserve_num_sequences_running"] + m["jaxserve_num_sequences_waiting"] == 24:
            break
        time.sleep(0.02)
    for sock in socks:
        sock.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
        m = server.metrics()
        if m["jaxserve_num_sequences_running"] == m["jaxserve_num_sequences_waiting"] == 0:
            break
        time.sleep(0.05)
    assert m["jaxserve_num_sequences_running"] == m["jaxserve_num_sequences_waiting"] == 0
    assert m["jaxserve_kv_cache_usage_ratio"] == 0
    assert server.log_tail(10**6).count("aborted (client gone") - aborted_before == 24
    assert m["jaxserve_generation_tokens_total"] - before < 24 * 2000 / 2


def test_chunks_arrive_while_generating(server):
    """Each token's chunk is sent when its step ends, not buffered to the end of the request.
    1000 tokens: steps take about a millisecond, so 100 fit in one scheduling hiccup of a busy box."""
    t0 = time.monotonic()
    r = post(server, C, {**OK, "max_tokens": 1000, "ignore_eos": True, "logprobs": 0, "stream": True}, stream=True)
    arrivals = [time.monotonic() for line in r.iter_lines() if line.startswith(b"data: {")]
    assert len(arrivals) == 1000
    first, last = arrivals[0], arrivals[-1]
    assert last - first > 0.5 * (last - t0)
    in_first_half = sum(t < (first + last) / 2 for t in arrivals) / len(arrivals)
    assert 0.2 < in_first_half < 0.8, in_first_half


def test_metrics_follow_requests(server):
    before = server.metrics()
    usage = post(server, C, {**OK, "max_tokens": 5, "ignore_eos": True}).json()["usage"]
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    assert delta("jaxserve_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("jaxserve_generation_tokens_total") == usage["completion_tokens"] == 5
    assert delta('jaxserve_request_success_total{finish_reason="length"}') == 1
    for h in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert delta(f"jaxserve_{h}_seconds_count") == 1
    assert delta("jaxserve_inter_token_latency_seconds_count") == 4
    assert after["jaxserve_xla_compilations_total"] > 0 and delta("jaxserve_xla_compilations_total") == 0
    assert after["jaxserve_e2e_request_latency_seconds_sum"] > before.get("jaxserve_e2e_request_latency_seconds_sum", 0)
    assert {"jaxserve_prefix_cache_hit_rate", "jaxserve_num_preemptions_total"} <= set(after)


# ---- the README quick start, as written (only host:port substituted) ----

def test_readme_examples_work(server):
    with open(README) as f:
        readme = f.read()
    blocks = re.findall(r"```(\w+)\n(.*?)```", readme, re.S)
    curl = [code for lang, code in blocks if lang in ("bash", "sh") and "curl " in code]
    python = [code for lang, code in blocks if lang == "python" and "openai" in code]
    assert curl and python
    here = f"127.0.0.1:{server.port}"
    for code in curl:
        out = subprocess.run(["bash", "-c", code.replace("127.0.0.1:8000", here)], capture_output=True,
                             text=True, timeout=120, check=True).stdout
        assert json.loads(out)["choices"]
    for code in python:
        out = subprocess.run([sys.executable, "-c", code.replace("127.0.0.1:8000", here)], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
