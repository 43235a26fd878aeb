"""The soak's mixed load (benchmarks/soak.py): one request of a random kind at a time per client,
sent with `requests`, and the judgement of how it ended.

Kinds: streamed and plain completions (n up to 3, stop strings, ignore_eos), chat, long prompts
(random token ids: with the soak's small KV pool they force preemption), clients that leave
mid-stream, requests with a deadline too short to meet, and malformed requests (10%).

Every request ends in one outcome: "ok" (full output: each choice has a finish reason, and the
token count is exact where it is known), "engine_error" (500, or an error event in a stream,
with code engine_error: an injected fault), "timeout" (408 request_timeout), "left" (the client
left on purpose), "rejected" (a malformed request refused with 4xx and an OpenAI error body),
or "LOST: why" for anything else (no [DONE], a missing finish reason, a wrong count, another
status, a broken connection).
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import requests

KINDS = {"stream": 0.25, "plain": 0.15, "chat": 0.1, "long": 0.2, "leave": 0.1, "deadline": 0.1,
         "malformed": 0.1}
STOPS = [".", "\n", " the"]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches "
         "in the old town by the river").split()
MALFORMED = [   # (path, body: dict or raw bytes, content type)
    ("/v1/completions", b"{not json", "application/json"),
    ("/v1/completions", {"prompt": "x", "temperature": 7}, "application/json"),
    ("/v1/completions", {"prompt": "x", "n": 100}, "application/json"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, "application/json"),
    ("/v1/completions", {"prompt": [10**7]}, "application/json"),
    ("/v1/completions", {"prompt": "x", "timeout": -1}, "application/json"),
    ("/v1/chat/completions", {"messages": "hi"}, "application/json"),
    ("/v1/completions", b"prompt=x", "text/plain"),
]
CLIENT_TIMEOUT_S = 300   # a request the server never ends is LOST, not waited on for ever


@dataclasses.dataclass
class Result:
    kind: str
    sent: float            # seconds since the soak started
    outcome: str
    ttft: float | None = None   # streams: send to the first event


class Client:
    """Sends one request at a time. Its first len(KINDS) requests are each kind once, in KINDS'
    order from the `first`-th on (clients given different `first`s cover every kind between them
    even when a loaded box lets each send only a few); later kinds are drawn by KINDS' weights."""

    def __init__(self, url: str, vocab_size: int, seed: int, t0: float, first: int = 0):
        self.url, self.vocab_size, self.t0 = url, vocab_size, t0
        self.rng = np.random.default_rng(seed)
        self.session = requests.Session()
        names = list(KINDS)
        self.opening = names[first % len(names):] + names[:first % len(names)]

    def one(self) -> Result:
        kind = self.opening.pop(0) if self.opening else self.rng.choice(list(KINDS), p=list(KINDS.values()))
        sent = time.monotonic()
        try:
            outcome, ttft = getattr(self, "_" + kind)()
        except requests.RequestException as e:
            outcome, ttft = f"LOST: {type(e).__name__}: {e}"[:300], None
        return Result(kind, sent - self.t0, outcome, ttft)

    # ---- kinds ----
    def _stream(self):
        return self._completion(stream=True, **self._sampling())

    def _plain(self):
        return self._completion(stream=False, **self._sampling())

    def _chat(self):
        body = {"messages": [{"role": "user", "content": self._text(4, 20)}], **self._sampling()}
        return self._send("/v1/chat/completions", body, bool(self.rng.random() < 0.5))

    def _long(self):
        ids = self.rng.integers(3, self.vocab_size, int(self.rng.integers(300, 450))).tolist()
        body = {"prompt": ids, "max_tokens": int(self.rng.integers(100, 180)), "ignore_eos": True,
                "temperature": 0.8, "n": int(self.rng.integers(1, 3))}
        return self._send("/v1/completions", body, bool(self.rng.random() < 0.5))

    def _deadline(self):
        body = {"prompt": self._text(4, 20), "max_tokens": 400, "ignore_eos": True,
                "timeout": float(self.rng.uniform(0.02, 0.3))}
        return self._send("/v1/completions", body, bool(self.rng.random() < 0.5))

    def _leave(self):
        """A stream the client drops after a few events."""
        body = {"prompt": self._text(4, 20), "max_tokens": 300, "ignore_eos": True, "stream": True}
        with self.session.post(self.url + "/v1/completions", json=body, stream=True,
                               timeout=CLIENT_TIMEOUT_S) as r:
            if r.status_code != 200:
                return _error_outcome(r.status_code, r.json()), None
            t0, ttft = time.monotonic(), None
            for _, line in zip(range(int(self.rng.integers(1, 6))), (x for x in r.iter_lines() if x)):
                ttft = ttft or time.monotonic() - t0
        return "left", ttft

    def _malformed(self):
        path, body, ctype = MALFORMED[int(self.rng.integers(len(MALFORMED)))]
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = self.session.post(self.url + path, data=data, headers={"Content-Type": ctype},
                              timeout=CLIENT_TIMEOUT_S)
        error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
        if 400 <= r.status_code < 500 and isinstance(error.get("message"), str) and error["message"]:
            return "rejected", None
        return f"LOST: malformed {body!r:.60} got {r.status_code}", None

    # ---- helpers ----
    def _text(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS, int(self.rng.integers(lo, hi))))

    def _sampling(self) -> dict:
        body = {"max_tokens": int(self.rng.integers(8, 64)), "n": int(self.rng.integers(1, 4)),
                "temperature": float(self.rng.choice([0.0, 0.7, 1.0])), "ignore_eos": bool(self.rng.random() < 0.5)}
        if self.rng.random() < 0.3:
            body["stop"] = STOPS[:int(self.rng.integers(1, len(STOPS) + 1))]
        if self.rng.random() < 0.2:   # penalised rows (multi-step decodes: their own compiled variant)
            body["presence_penalty"] = float(self.rng.choice([0.5, 1.0]))
        return body

    def _completion(self, stream: bool, **sampling):
        return self._send("/v1/completions", {"prompt": self._text(2, 30), **sampling}, stream)

    def _send(self, path: str, body: dict, stream: bool):
        body = {**body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
        t0 = time.monotonic()
        with self.session.post(self.url + path, json=body, stream=stream, timeout=CLIENT_TIMEOUT_S) as r:
            if r.status_code != 200:
                return _error_outcome(r.status_code, r.json()), None
            if not stream:
                return _judge(body, r.json()["choices"], r.json()["usage"]), None
            events, ttft = [], None
            for line in r.iter_lines():
                if line:
                    ttft = ttft or time.monotonic() - t0
                    events.append(line)
        return _judge_stream(body, events), ttft


def _error_outcome(status: int, body: dict) -> str:
    code = body.get("error", {}).get("code")
    if (status, code) == (500, "engine_error"):
        return "engine_error"
    if (status, code) == (408, "request_timeout"):
        return "timeout"
    return f"LOST: status {status}: {json.dumps(body)[:200]}"


def _judge_stream(body: dict, events: list[bytes]) -> str:
    if not events or events[-1] != b"data: [DONE]":
        return f"LOST: stream without [DONE] after {len(events)} events"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    if chunks and "error" in chunks[-1]:
        return _error_outcome({"engine_error": 500, "request_timeout": 408}.get(chunks[-1]["error"]["code"], 0),
                              chunks[-1])
    choices: dict[int, dict] = {}
    for c in chunks:
        for ch in c["choices"]:
            acc = choices.setdefault(ch["index"], {"index": ch["index"], "text": "", "finish_reason": None})
            acc["text"] += ch["delta"].get("content", "") if "delta" in ch else ch["text"]
            acc["finish_reason"] = ch["finish_reason"] or acc["finish_reason"]
    usage = chunks[-1].get("usage") if chunks else None
    if usage is None:
        return "LOST: stream without its usage chunk"
    return _judge(body, [choices[i] for i in sorted(choices)], usage)


def _judge(body: dict, choices: list[dict], usage: dict) -> str:
    """Full output: n choices, each with a finish reason; no stop string in the text; with
    ignore_eos and no stop strings, exactly max_tokens each."""
    n = body.get("n", 1)
    if len(choices) != n:
        return f"LOST: {len(choices)} choices of {n}"
    for ch in choices:
        text = ch["message"]["content"] if "message" in ch else ch["text"]
        if ch["finish_reason"] not in ("stop", "length"):
            return f"LOST: choice {ch['index']} finish_reason {ch['finish_reason']!r}"
        if any(s in text for s in body.get("stop", [])):
            return f"LOST: choice {ch['index']} holds a stop string: {text!r:.80}"
    if body.get("ignore_eos") and not body.get("stop") and usage["completion_tokens"] != n * body["max_tokens"]:
        return f"LOST: {usage['completion_tokens']} tokens, not {n} x {body['max_tokens']}"
    return "ok"
