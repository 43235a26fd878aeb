"""Bug hunt through the OpenAI API of a running server: random requests, as a client would send.

Start a server first (any config: a tight pool with `decode_steps: 4` makes it preempt and run
multi-step decodes; `--speculative-config` adds verify rows), then:

    jaxserve serve --port 8011 &
    python scripts/fuzz_http.py --url http://127.0.0.1:8011 --requests 400 [--hostile] [--seed 1]

1. `--requests` random requests, 8 at a time: completions, chat and responses, streamed or not, some clients
   leaving mid-stream; parameters over the whole API (sampling, penalties, bias, stops, n,
   logprobs, echo, prompt logprobs, response_format, guided fields, tools, cache salts, priorities);
   with `--hostile` also values of the wrong type or range and malformed bodies. Every answer must
   be 200 or a 4xx JSON error; a 200 body must be consistent (finish reasons, usage, logprobs
   lengths, text offsets in order), a stream must end in [DONE] with no error chunk.
2. `--pairs` seeded requests, each streamed and not: the same choices (text, finish reason,
   logprob tokens).
3. Then, idle: the server is healthy, runs nothing and has every KV page free again.

Found so far (fixed): a penalised request's stop failing its step (HTTP 500 for every request
in it), echoed prompt tokens' text_offset going backwards, and (`--hostile`) a top_k or stop
token id too large for the sampler's int32 arrays failing its step.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import json
import random
import time

import requests

WRONG = [None, -1, 0, 2.5, "x", [], {}, True, 1e30, "NaN", [1, "a"], 10**20, ""]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OPTIONS = {
    "temperature": [0, 0.7, 1.0, 2.0], "top_p": [1.0, 0.9, 0.1], "top_k": [-1, 1, 5, 50], "min_p": [0.0, 0.1, 0.9],
    "n": [1, 2, 3], "seed": [0, 1, 42, 2**40], "stop": ["\n", ["a", "b"], "the", "e", " "],
    "stop_token_ids": [[1], [2, 3]], "presence_penalty": [0.0, 1.0, -2.0], "frequency_penalty": [0.0, 0.5, -1.5],
    "repetition_penalty": [1.0, 1.2, 0.5], "logprobs": [None, 0, 1, 5, 20], "min_tokens": [0, 3],
    "ignore_eos": [True, False], "logit_bias": [{"5": 100}, {"5": -100}, {"7": 3}], "prompt_logprobs": [0, 1, 3],
    "include_stop_str_in_output": [True, False], "skip_special_tokens": [True, False], "user": ["u"],
    "response_format": [{"type": "json_object"}, {"type": "text"},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}],
    "guided_regex": ["[ab]{3}", "a+"], "guided_choice": [["yes", "no"]], "truncate_prompt_tokens": [1, 3, 100, -1],
    "guided_grammar": ['root ::= "a" [0-9]+', 'start: "[" ("x" | start)* "]"'],
    "structured_outputs": [{"regex": "[ab]{2}"}, {"grammar": 'root ::= "(" [0-9] ")"'}, {"json_object": True}],
    "priority": [0, 1], "cache_salt": ["a", "b"], "stream_options": [{"include_usage": True}],
    "chat_template_kwargs": [{"enable_thinking": False}, {"bos_token": "X"}], "add_generation_prompt": [True, False],
    "continue_final_message": [True, False], "return_token_ids": [True, False],
}
PROMPTS = ["Hello", " ", "\u00e9t\u00e9 \U0001F600", "The quick brown fox", [1, 2, 3], [[1, 2], [3]], ["a", "b"]]
HOSTILE_PROMPTS = ["", "a" * 3000, [], [[]], [-5], [10**9], 123, None, {"a": 1}]
MESSAGES = [[{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "s"}, {"role": "user", "content": "\U0001F600"}],
            [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get", "arguments": '{"city": "Rome"}'}}]},
             {"role": "tool", "tool_call_id": "c", "content": "sunny"}]]
INPUTS = ["hi", [{"role": "user", "content": "hi"}],   # /v1/responses' input
          [{"role": "developer", "content": "s"}, {"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": "\U0001F600"}]}],
          [{"role": "user", "content": "weather?"}, {"type": "function_call", "call_id": "c", "name": "get",
                                                     "arguments": '{"city": "Rome"}'},
           {"type": "function_call_output", "call_id": "c", "output": "sunny"}, {"type": "reasoning", "summary": []}]]
HOSTILE_INPUTS = [[], 5, [{"role": "user", "content": 5}], [{"type": "item_reference", "id": "x"}],
                  [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]]
TEXT_FORMATS = [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": SCHEMA}]
HOSTILE_MESSAGES = [[], [{"role": "bogus", "content": "x"}], [{"role": "user"}], "hi",
                    [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "g", "arguments": "{"}}]}],
                    [{"role": "assistant", "tool_calls": "x"}], [{"role": "tool", "content": 5}]]


class Fuzz:
    def __init__(self, url: str, seed: int, hostile: bool):
        self.url, self.rng, self.hostile = url, random.Random(seed), hostile
        self.model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        self.outcomes, self.failures = collections.Counter(), []

    def pick(self, values: list, hostile_values: list = WRONG):
        return self.rng.choice(hostile_values if self.hostile and self.rng.random() < 0.15 else values)

    def body(self, chat: bool) -> dict:
        body = {"model": self.model if self.rng.random() > 0.03 else "nope", "max_tokens": self.rng.choice([8, 16])}
        for name in self.rng.sample(sorted(OPTIONS), self.rng.randint(0, 6)):
            body[name] = self.pick(OPTIONS[name])
        if chat:
            body["messages"] = self.pick(MESSAGES, HOSTILE_MESSAGES)
            if body.get("logprobs") is not None and self.rng.random() < 0.7:
                body["top_logprobs"], body["logprobs"] = body["logprobs"], True
            if self.rng.random() < 0.3:
                for name in ("response_format", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"):
                    body.pop(name, None)
                body.update(tools=TOOLS, max_tokens=60, tool_choice=self.rng.choice(
                    ["required", "none", "auto", {"type": "function", "function": {"name": "get"}}]))
        else:
            body["prompt"] = self.pick(PROMPTS, HOSTILE_PROMPTS)
            body["echo"] = self.rng.random() < 0.2
        return body

    def responses_body(self) -> dict:
        """A /v1/responses body: a chat body's sampling fields, with the Responses API's own."""
        body = self.body(chat=True)
        for name in ("messages", "n", "logprobs", "top_logprobs", "response_format", "stream_options", "tools",
                     "tool_choice", "prompt_logprobs", "add_generation_prompt", "continue_final_message"):
            body.pop(name, None)
        body.update(input=self.pick(INPUTS, HOSTILE_INPUTS), max_output_tokens=body.pop("max_tokens"))
        if self.rng.random() < 0.3:
            body["instructions"] = self.pick(["Be brief."])
        if self.rng.random() < 0.3:
            body["text"] = {"format": self.pick(TEXT_FORMATS)}
        elif self.rng.random() < 0.3:
            body.update(tools=[{"type": "function", **t["function"]} for t in TOOLS], max_output_tokens=60,
                        tool_choice=self.pick(["required", "none", "auto", {"type": "function", "name": "get"}]))
        return body

    def one(self) -> str:
        kind, stream = self.rng.choice(["completions", "completions", "chat", "responses"]), self.rng.random() < 0.35
        chat = kind == "chat"
        body = {**(self.responses_body() if kind == "responses" else self.body(chat)), "stream": stream}
        data = json.dumps(body)
        if self.hostile and self.rng.random() < 0.03:
            data = self.rng.choice(["{", "[]", "null", '{"prompt": NaN}'])
        r = requests.post(f"{self.url}/v1/{kind.replace('chat', 'chat/completions')}", data=data,
                          headers={"Content-Type": "application/json"}, stream=stream, timeout=300)
        if r.status_code != 200:
            assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
            assert isinstance(r.json()["error"]["message"], str), r.text[:300]
            return f"{r.status_code}"
        if stream and self.rng.random() < 0.3:   # a client that leaves mid-stream
            for _ in zip(range(self.rng.randint(0, 3)), r.iter_lines()):
                pass
            r.close()
            return "left"
        if stream:
            lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == b"data: [DONE]", lines[-3:]
            bad = [line for line in lines[:-1] if not line.startswith(b"data: ") or "error" in json.loads(line[6:])]
            assert not bad, bad[:2]
            if kind == "responses":
                events = [json.loads(line[6:]) for line in lines[:-1]]
                assert [e["sequence_number"] for e in events] == list(range(len(events))), events[:3]
                check_response(events[-1]["response"])
            return f"200 {kind} stream"
        if kind == "responses":
            check_response(r.json())
        else:
            check_body(body, r.json(), chat)
        return f"200 {kind}"

    def run(self, n: int) -> None:
        with cf.ThreadPoolExecutor(8) as pool:
            for future in cf.as_completed([pool.submit(self.one) for _ in range(n)]):
                try:
                    self.outcomes[future.result()] += 1
                except Exception as e:   # noqa: BLE001 (every failure is reported)
                    self.failures.append(repr(e)[:500])

    def seeded_pairs(self, n: int) -> None:
        """Seeded requests streamed and not: the same choices."""
        hostile, self.hostile = self.hostile, False
        for _ in range(n):
            chat = self.rng.random() < 0.4
            body = {**self.body(chat), "seed": self.rng.randint(0, 99), "max_tokens": self.rng.randint(1, 24)}
            for name in ("tools", "tool_choice", "prompt_logprobs", "echo", "stream_options"):
                body.pop(name, None)
            path = self.url + ("/v1/chat/completions" if chat else "/v1/completions")
            r = requests.post(path, json=body, timeout=300)
            if r.status_code != 200:
                continue
            whole = {c["index"]: (texts(c["message"]) if chat else c["text"], c["finish_reason"],
                                  logprob_tokens(c.get("logprobs"), chat)) for c in r.json()["choices"]}
            lines = [line for line in requests.post(path, json={**body, "stream": True}, stream=True,
                                                    timeout=300).iter_lines() if line]
            if whole != merged(lines[:-1], chat):
                self.failures.append(f"streamed != not streamed: {body}\n  {whole}\n  {merged(lines[:-1], chat)}")
            self.outcomes["seeded pair"] += 1
        self.hostile = hostile


def logprob_tokens(logprobs, chat: bool) -> list:
    if not logprobs:
        return []
    return [e["token"] for e in logprobs["content"]] if chat else logprobs["tokens"]


def texts(message: dict) -> str:
    """A chat message's (or delta's) content and reasoning (--reasoning-parser), as one string."""
    return f"{message.get('content') or ''}\0{message.get('reasoning_content') or ''}"


def merged(lines: list[bytes], chat: bool) -> dict:
    """A stream's chunks as {choice index: (text, finish reason, logprob tokens)}."""
    out = {}
    for line in lines:
        for c in json.loads(line[6:])["choices"]:
            text, finish, tokens = out.get(c["index"], ("\0" if chat else "", None, []))
            if chat:
                (content, reasoning), (more, more_reasoning) = text.split("\0"), texts(c["delta"]).split("\0")
                text = f"{content}{more}\0{reasoning}{more_reasoning}"
            else:
                text += c["text"]
            tokens = tokens + logprob_tokens(c.get("logprobs"), chat)
            out[c["index"]] = (text, c["finish_reason"] or finish, tokens)
    return out


def check_body(body: dict, d: dict, chat: bool) -> None:
    """A 200 body's own consistency."""
    assert d["choices"], d
    for c in d["choices"]:
        assert c["finish_reason"] in ("stop", "length", "tool_calls"), c
        lp = c.get("logprobs")
        if lp and not chat:
            n = len(lp["tokens"])
            assert len(lp["token_logprobs"]) == n == len(lp["text_offset"]) == len(lp["top_logprobs"] or [None] * n), lp
            assert lp["text_offset"] == sorted(lp["text_offset"]), lp["text_offset"]
            assert all(x is None or x <= 0 for x in lp["token_logprobs"]), lp
        elif lp and lp.get("content") is not None:
            want_top = body.get("top_logprobs") or 0
            assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == want_top for e in lp["content"]), lp
    u = d["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
    if body.get("return_token_ids") is True:   # every sampled token, stop tokens too, is a choice's
        assert sum(len(c["token_ids"]) for c in d["choices"]) == u["completion_tokens"], (u, d["choices"])
        assert all(c.get("prompt_token_ids") for c in d["choices"]) if not chat else d["prompt_token_ids"], d


def check_response(d: dict) -> None:
    """A finished Response's own consistency."""
    assert d["object"] == "response" and d["status"] in ("completed", "incomplete"), d
    assert (d["status"] == "incomplete") == (d["incomplete_details"] is not None), d
    assert all(item["type"] in ("message", "reasoning", "function_call") for item in d["output"]), d["output"]
    assert all(json.loads(item["arguments"]) is not None for item in d["output"] if item["type"] == "function_call")
    u = d["usage"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"], u


def idle_state(url: str) -> dict[str, float]:
    text = requests.get(url + "/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("jaxserve_kv_free_pages", "jaxserve_num_sequences_"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8011")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hostile", action="store_true", help="also wrong types and ranges, malformed bodies")
    args = parser.parse_args()
    before = idle_state(args.url)
    fuzz = Fuzz(args.url, args.seed, args.hostile)
    fuzz.run(args.requests)
    fuzz.seeded_pairs(args.pairs)
    time.sleep(3)   # aborts of clients that left land
    after = idle_state(args.url)
    if after != before or requests.get(args.url + "/health", timeout=30).status_code != 200:
        fuzz.failures.append(f"not back to idle: before {before}, after {after}")
    print(dict(fuzz.outcomes))
    for failure in fuzz.failures[:20]:
        print("FAILED", failure)
    print(f"{len(fuzz.failures)} failures")
    raise SystemExit(1 if fuzz.failures else 0)


if __name__ == "__main__":
    main()
