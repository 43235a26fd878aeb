"""vLLM's request extras and tenant-salted prefix caching, through one real server (subprocess)
started with per-tenant API keys. Generated text is checked against greedy loops over the same
checkpoint in transformers, with the bias or ban applied to its logits."""
import importlib.metadata
import json
import statistics

import numpy as np
import openai
import pytest
import requests
import torch

from tests.hf_models import hf_greedy
from tests.server_harness import BYTES_ENGINE, BYTES_MAX_LEN, TEST_ENGINE, bytes_model, openai_client, serving

NAME = "tiny-extras"
MAX_LEN = BYTES_MAX_LEN
KEYS = {"key-a1": "tenant-a", "key-a2": "tenant-a", "key-b": "tenant-b"}
EOS = 257
PREFIX = 512     # shared prompt tokens: 16 pages of TEST_ENGINE's 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return bytes_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("server")
    keys_file = workdir / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    yield from serving(workdir, model[0], "--served-model-name", NAME, "--api-keys-file", str(keys_file),
                      **BYTES_ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server, "key-a1")


def biased(bias: dict[int, float]):
    def adjust(step, logits):
        for t, b in bias.items():
            logits[t] += b
        return logits
    return adjust


def complete(client, prompt, **extra):
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=extra.pop("max_tokens", 8),
                                     extra_body=extra)


def post(server, path: str, body: dict, key: str = "key-a1", **kw) -> requests.Response:
    return requests.post(server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax in f32 at each prompt position but the last."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)


def test_echo_logprobs_match_transformers(server, client, model):
    """An eval harness's loglikelihood requests: token-id prompts in a batch (one longer than the
    prefill chunk), echo with logprobs 1 and max_tokens 1 or 0. Prompt logprobs skip the prefix
    cache (cached pages have no hidden states) but their pages are cached for later requests."""
    _, hf, tok = model
    rng = np.random.default_rng(19)
    prompts = [rng.integers(0, 256, 3 * TEST_ENGINE["prefill_chunk_size"] + 5).tolist(), rng.integers(0, 256, 9).tolist()]
    refs = [hf_prompt_logprobs(hf, p) for p in prompts]
    out = complete(client, prompts, echo=True, logprobs=1, max_tokens=1)
    for c, p, ref in zip(out.choices, prompts, refs):
        lp = c.logprobs
        assert c.text.startswith(tok.decode(p)) and len(lp.tokens) == len(p) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = np.array(lp.token_logprobs[1:len(p)])
        assert np.abs(got - ref[np.arange(len(p) - 1), p[1:]].numpy()).max() < 1e-4
        assert [list(t) for t in lp.top_logprobs[1:len(p)]] == [[tok.decode([int(i)])] for i in ref.argmax(-1)]
        assert lp.text_offset[len(p)] == len(tok.decode(p))   # the completion token follows the echo
    # The same long prompt again: a prefix-cache hit is skipped, nothing else changes; max_tokens 0.
    warm = complete(client, prompts[0] + [7], max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens >= 3 * TEST_ENGINE["page_size"]
    again = complete(client, prompts[0], echo=True, logprobs=1, max_tokens=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.usage.completion_tokens == 0
    assert again.choices[0].text == tok.decode(prompts[0]) and again.choices[0].finish_reason == "length"
    assert again.choices[0].logprobs.token_logprobs[1:] == pytest.approx(out.choices[0].logprobs.token_logprobs[1:-1], abs=1e-5)
    chunks = client.completions.create(model=NAME, prompt=prompts[1], echo=True, logprobs=1, max_tokens=1,
                                       temperature=0, stream=True)
    streamed = sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), [])
    assert streamed[0] is None and streamed[1:] == pytest.approx(out.choices[1].logprobs.token_logprobs[1:], abs=1e-5)
    # vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}}, the token and the top-N.
    body = post(server, "/v1/completions", {"model": NAME, "prompt": prompts[1], "max_tokens": 1,
                                            "prompt_logprobs": 2}).json()
    check_prompt_logprobs(body["choices"][0]["prompt_logprobs"], prompts[1], refs[1], 2)


def check_prompt_logprobs(entries: list, ids: list[int], ref: torch.Tensor, top: int) -> None:
    """vLLM's prompt_logprobs against transformers' log-softmax `ref`: None for the first token,
    then per token {id: {logprob, rank, decoded_token}} holding the token and the top N."""
    assert entries[0] is None and len(entries) == len(ids)
    for row, token, entry in zip(ref, ids[1:], entries[1:]):
        assert entry[str(token)]["rank"] == 1 + int((row > row[token]).sum())
        assert set(entry) == {str(token)} | {str(t) for t in torch.topk(row, top).indices.tolist()}
        assert all(abs(v["logprob"] - row[int(t)].item()) < 1e-4 for t, v in entry.items())


def test_chat_prompt_logprobs_match_transformers(server, model):
    """prompt_logprobs on chat (vLLM's): the rendered prompt's, once in the response, whatever n;
    max_tokens 0 scores the prompt only; not with stream (400, as vLLM)."""
    _, hf, _ = model
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    ids = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    ref = hf_prompt_logprobs(hf, ids)
    for extra in ({"max_tokens": 2, "n": 2, "temperature": 0.8}, {"max_tokens": 0}):
        r = post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "prompt_logprobs": 3, **extra})
        body = r.json()
        assert r.status_code == 200 and body["usage"]["prompt_tokens"] == len(ids), body
        check_prompt_logprobs(body["prompt_logprobs"], ids, ref, 3)
        assert len(body["choices"]) == extra.get("n", 1) and all("prompt_logprobs" not in c for c in body["choices"])
    assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo_text_offsets_index_the_text(client, model):
    """text_offset is each token's first character in the returned text, prompt tokens too: a
    special token adds no text, and a byte inside a character gets the character's start."""
    prompt = "h\u00e9llo w\u00f6rld \U0001F600!"
    ids = [256] + model[2].encode(prompt, add_special_tokens=False)   # bos, then a token a byte
    assert len(ids) == 1 + len(prompt.encode())
    choice = complete(client, ids, echo=True, logprobs=0, max_tokens=6, ignore_eos=True).choices[0]
    offsets = choice.logprobs.text_offset
    assert offsets[:len(ids)] == [0] + [len(prompt.encode()[:i].decode(errors="ignore")) for i in range(len(ids) - 1)]
    assert offsets[len(ids)] == len(prompt) and choice.text.startswith(prompt)
    assert offsets == sorted(offsets) and offsets[-1] <= len(choice.text)


def test_logit_bias_and_min_tokens_match_transformers(client, model):
    _, hf, tok = model
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    z, e = tok.encode("ze", add_special_tokens=False)
    out = complete(client, prompt, logit_bias={str(z): 100}, ignore_eos=True)
    assert out.choices[0].text == "z" * 8
    bias = {z: 2.0, e: 3.5, 32: -4.0}
    out = complete(client, prompt, logit_bias={str(t): b for t, b in bias.items()}, ignore_eos=True)
    assert out.choices[0].text == tok.decode(hf_greedy(hf, prompt, 8, biased(bias))[0])

    # A +100 eos bias ends every sequence at once, unless min_tokens bans eos for 4 tokens.
    out = complete(client, prompt, logit_bias={str(EOS): 100})
    assert (out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens) == ("", "stop", 1)
    out = complete(client, prompt, logit_bias={str(EOS): 100}, min_tokens=4, logprobs=0)

    def ban_eos_first_4(step, logits):
        logits[EOS] = -np.inf if step < 4 else logits[EOS] + 100
        return logits
    ref, ref_logprobs = hf_greedy(hf, prompt, 5, ban_eos_first_4)
    assert ref[4] == EOS and EOS not in ref[:4]
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", 5)
    # The tokens, by their (raw) logprobs, eos too (as vLLM); the text holds back an incomplete
    # last character.
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    assert out.choices[0].logprobs.tokens[-1] == "</s>"
    assert out.choices[0].text == tok.decode(ref[:4]).rstrip("\ufffd")


def test_allowed_token_ids_match_transformers(client, model):
    """vLLM's allowed_token_ids: greedy tokens are transformers' argmax over those tokens (their
    logprobs raw, as vLLM's), sampled ones stay among them, a grammar's mask is narrowed by them,
    and an empty list or an id past the vocabulary is a 400."""
    _, hf, tok = model
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    allowed = tok.encode("aeiou", add_special_tokens=False) + [EOS]

    def only_allowed(step, logits):
        banned = torch.ones_like(logits, dtype=torch.bool)
        banned[allowed] = False
        return logits.masked_fill(banned, -np.inf)
    ref, ref_logprobs = hf_greedy(hf, prompt, 8, only_allowed)
    n = ref.index(EOS) + 1 if EOS in ref else len(ref)
    out = complete(client, prompt, allowed_token_ids=allowed, logprobs=0, return_token_ids=True)
    assert out.choices[0].model_extra["token_ids"] == ref[:n] and n > 2
    assert out.choices[0].logprobs.token_logprobs == pytest.approx(ref_logprobs[:n], abs=1e-3)
    sampled = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=1.5, n=3, seed=1,
                                        extra_body=dict(allowed_token_ids=allowed[:5], ignore_eos=True))
    assert all(set(c.text) <= set("aeiou") and len(c.text) == 16 for c in sampled.choices)
    regex = complete(client, prompt, allowed_token_ids=allowed[:3], guided_regex="[a-z]{6}", max_tokens=10)
    assert len(regex.choices[0].text) == 6 and set(regex.choices[0].text) <= set("aei")
    for bad in ([], [300]):
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, prompt, allowed_token_ids=bad)
        assert e.value.body["param"] == "allowed_token_ids"


def test_bad_words_match_transformers(client, model):
    """vLLM's bad_words: a word's last token is banned where the outputs end in its other tokens
    (one-token words: always). With "a" and "z" pushed up by logit_bias and bad words "aa" and
    "z", greedy writes "a" every other token: transformers' greedy under the same bias and bans.
    (How words become token ids: tests/test_token_limits.py.)"""
    _, hf, tok = model
    prompt = tok.encode("The quick brown fox", add_special_tokens=False)
    a, z = tok.encode("az", add_special_tokens=False)
    bias = {a: 100.0, z: 50.0}
    ids, ref = list(prompt), []
    with torch.no_grad():
        for _ in range(8):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            for t, b in bias.items():
                logits[t] += b
            logits[z] = -np.inf                        # "z": always
            if ref and ref[-1] == a:
                logits[a] = -np.inf                    # "aa": after an "a"
            ref.append(int(logits.argmax()))
            ids.append(ref[-1])
    assert ref[::2] == [a] * 4 and a not in ref[1::2]
    out = complete(client, prompt, logit_bias={str(t): b for t, b in bias.items()}, bad_words=["aa", " z"],
                   ignore_eos=True, return_token_ids=True)
    assert out.choices[0].model_extra["token_ids"] == ref
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt, bad_words=[" "])
    assert e.value.body["param"] == "bad_words"


def test_stop_string_and_special_token_options(client, model):
    _, hf, tok = model
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    letters = {t: 50.0 for t in tok.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)}
    text = tok.decode(hf_greedy(hf, prompt, 12, biased(letters))[0])   # the random model's text, in letters
    stop = text[5:7]
    pos = text.find(stop)
    kw = dict(max_tokens=12, ignore_eos=True, stop=stop, logit_bias={str(t): b for t, b in letters.items()})
    assert complete(client, prompt, **kw).choices[0].text == text[:pos]
    out = complete(client, prompt, include_stop_str_in_output=True, **kw)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (text[:pos + len(stop)], "stop")

    eos_only = dict(max_tokens=3, ignore_eos=True, logit_bias={str(EOS): 100})
    assert complete(client, prompt, **eos_only).choices[0].text == ""
    assert complete(client, prompt, skip_special_tokens=False, **eos_only).choices[0].text == "</s>" * 3
    out = complete(client, prompt, skip_special_tokens=False, include_stop_str_in_output=True,
                   logit_bias={str(EOS): 100})
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("</s>", "stop")


def test_limits_usage_and_info_routes(server, client, model):
    _, hf, tok = model
    prompt = tok.encode("A long prompt of twenty tokens.", add_special_tokens=False)[:20]
    assert complete(client, prompt, max_tokens=None, max_completion_tokens=5, ignore_eos=True).usage.completion_tokens == 5
    out = complete(client, prompt, truncate_prompt_tokens=6, ignore_eos=True)
    assert out.usage.prompt_tokens == 6 and out.choices[0].text == tok.decode(hf_greedy(hf, prompt[-6:], 8)[0])

    r = post(server, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                         "stream": True, "stream_options": {"continuous_usage_stats": True}},
             key="key-b", stream=True)
    events = [json.loads(line[6:]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
    counts = [ev["usage"]["completion_tokens"] for ev in events]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 1
    assert all(ev["usage"]["prompt_tokens"] == 20 for ev in events)

    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    version = requests.get(server.url + "/version", headers={"Authorization": "Bearer key-a1"}, timeout=30).json()
    assert version == {"version": importlib.metadata.version("jaxserve")}
    info = requests.get(server.url + "/tokenizer_info", headers={"Authorization": "Bearer key-a1"}, timeout=30).json()
    assert (info["eos_token"], info["eos_token_ids"], info["chat_template"]) == (tok.eos_token, [EOS], tok.chat_template)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # Chat's default max_tokens is the context left after truncation: min_tokens 5 fits it
    # (sized from the untruncated prompt it was 1: a 400); then eos, forced by its bias, ends it.
    long = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x" * (MAX_LEN + 100)}],
                                          extra_body=dict(truncate_prompt_tokens=50, min_tokens=5,
                                                          logit_bias={str(EOS): 100}))
    assert long.usage.prompt_tokens == 50 and long.choices[0].finish_reason == "stop"
    assert long.usage.completion_tokens in (5, 6)   # (with the eos or not)
    fingerprints = {chat.system_fingerprint, out.system_fingerprint, *(ev["system_fingerprint"] for ev in events)}
    assert len(fingerprints) == 1 and chat.system_fingerprint.startswith("fp_")


def test_tenants_never_share_prefix_cache(server):
    """A shared 512-token prefix: a second request of the same tenant (another key) finds it in
    the prefix cache and answers sooner; the other tenant finds nothing, whatever cache_salt it
    sends, and waits as long as a miss."""
    clients = {key: openai_client(server, key) for key in KEYS}

    def first_token(key, prefix, suffix, **extra):
        """(time to first token, cached tokens): the server's own TTFT (arrival to first token, from
        /metrics), free of the HTTP round trip's noise."""
        before = server.metrics()["jaxserve_time_to_first_token_seconds_sum"]
        out = complete(clients[key], prefix + suffix, max_tokens=1, **extra)
        seconds = server.metrics()["jaxserve_time_to_first_token_seconds_sum"] - before
        return seconds, out.usage.prompt_tokens_details.cached_tokens

    rng = np.random.default_rng(0)
    ttft = {"miss": [], "hit": [], "other tenant": []}
    for _ in range(5):
        prefix = rng.integers(0, 256, PREFIX).tolist()
        for case, key, suffix, want in (("miss", "key-a1", [1, 2, 3], 0), ("hit", "key-a2", [4, 5, 6], PREFIX),
                                        ("other tenant", "key-b", [7, 8, 9], 0)):
            seconds, cached = first_token(key, prefix, suffix)
            assert cached == want, case
            ttft[case].append(seconds)
        # No salt a client sends reaches another tenant's pages (nor its own unsalted ones).
        for key, salt in (("key-b", "tenant-a"), ("key-b", '["tenant-a", null]'), ("key-a1", "tenant-a")):
            assert first_token(key, prefix, [10, 11, 12], cache_salt=salt)[1] == 0
        assert first_token("key-a1", prefix, [13, 14, 15], cache_salt="tenant-a")[1] == PREFIX
    medians = {k: statistics.median(v) for k, v in ttft.items()}
    print("time to first token (median of 5, s):", medians)
    assert medians["hit"] < medians["other tenant"], medians


def test_return_token_ids(server, client, model):
    """vLLM's return_token_ids: each choice's token ids, a stop token among them (its text is not
    in the output), and the prompt's as the engine runs it (truncated: its last tokens); streamed,
    the chunks' ids add up to the same, the prompt's in the first chunk only."""
    tok = model[2]
    prompts = [tok.encode("Hello there", add_special_tokens=False), tok.encode("Bye", add_special_tokens=False)]
    out = complete(client, prompts, n=2, temperature=1.0, seed=3, max_tokens=6, return_token_ids=True,
                   truncate_prompt_tokens=8)
    for c in out.choices:
        extra, prompt = c.model_extra, prompts[c.index // 2][-8:]
        assert extra["prompt_token_ids"] == prompt and len(extra["token_ids"]) == 6
        assert tok.decode(extra["token_ids"]) == c.text
    [c] = complete(client, prompts[0], logit_bias={str(EOS): 100}, return_token_ids=True).choices
    assert (c.text, c.finish_reason, c.model_extra["token_ids"]) == ("", "stop", [EOS])
    chunks = [ch.choices[0] for ch in client.completions.create(
        model=NAME, prompt=prompts, n=2, temperature=1.0, seed=3, max_tokens=6, stream=True,
        extra_body={"return_token_ids": True, "truncate_prompt_tokens": 8})]
    for c in out.choices:
        mine = [ch.model_extra for ch in chunks if ch.index == c.index]
        assert sum((m["token_ids"] for m in mine), []) == c.model_extra["token_ids"]
        assert mine[0]["prompt_token_ids"] == c.model_extra["prompt_token_ids"]
        assert all("prompt_token_ids" not in m for m in mine[1:])

    msgs = [{"role": "user", "content": "hi"}]
    ids = post(server, "/tokenize", {"messages": msgs}).json()["tokens"]
    kw = dict(model=NAME, messages=msgs, temperature=0, max_tokens=5, extra_body={"return_token_ids": True})
    chat = client.chat.completions.create(**kw)
    assert chat.model_extra["prompt_token_ids"] == ids
    assert tok.decode(chat.choices[0].model_extra["token_ids"]) == chat.choices[0].message.content
    stream = list(client.chat.completions.create(stream=True, **kw))
    assert stream[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in ch.model_extra for ch in stream[1:])
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in stream), []) == chat.choices[0].model_extra["token_ids"]


def test_return_tokens_as_token_ids(client):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:ID" (the sampled
    ones' ids are return_token_ids'), with the same logprobs, offsets and bytes as by their text."""
    kw = dict(max_tokens=6, logprobs=2, return_token_ids=True)
    plain = complete(client, "Hello", **kw).choices[0]
    [c] = complete(client, "Hello", return_tokens_as_token_ids=True, **kw).choices
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]
    assert (c.logprobs.token_logprobs, c.logprobs.text_offset) == (plain.logprobs.token_logprobs,
                                                                   plain.logprobs.text_offset)
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in c.logprobs.top_logprobs)
    kw = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], temperature=0, max_tokens=4, logprobs=True,
              top_logprobs=2)
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content
    chat = client.chat.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True,
                                                            "return_token_ids": True}).choices[0]
    ids = chat.model_extra["token_ids"]
    assert [e.token for e in chat.logprobs.content] == [f"token_id:{t}" for t in ids]
    assert [(e.logprob, e.bytes) for e in chat.logprobs.content] == [(e.logprob, e.bytes) for e in plain]


def test_beam_search(server, client, model):
    """vLLM's use_beam_search with n beams: the n choices are transformers' beams, best first
    (jaxserve/beam_search.py's rules), on completions (with logprobs: each token's is its
    candidate's, summing to the beam's score) and chat, streamed or not; what a search cannot
    honour is a 400, and a prompt that fills the context is refused before the stream starts."""
    from tests.test_beam_search import hf_beams

    _, hf, tok = model
    prompt = [256] + list(b"Beams of ")
    want = hf_beams(hf, prompt, [EOS], 1.0, max_new_tokens=6, width=3)
    beam = dict(use_beam_search=True, return_token_ids=True)
    out = client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=6, logprobs=2, extra_body=beam)
    assert [c.model_extra["token_ids"] for c in out.choices] == [t for t, _ in want]
    for c, (tokens, score) in zip(out.choices, want):
        assert c.text == tok.decode([t for t in tokens if t != EOS])
        assert sum(c.logprobs.token_logprobs) == pytest.approx(score * len(tokens), rel=1e-4)
        top = c.logprobs.top_logprobs[0]   # the 2 most likely of its candidates (1 if both decode alike)
        assert len(top) in (1, 2) and max(top.values()) >= c.logprobs.token_logprobs[0]
    assert out.usage.completion_tokens == sum(len(t) for t, _ in want)
    streamed = [c for chunk in client.completions.create(model=NAME, prompt=prompt, n=3, max_tokens=6, stream=True,
                                                         extra_body=beam) for c in chunk.choices]
    assert ["".join(c.text for c in streamed if c.index == i) for i in range(3)] == [c.text for c in out.choices]

    messages = [{"role": "user", "content": "beams"}]
    ids = post(server, "/tokenize", {"model": NAME, "messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(model=NAME, messages=messages, n=2, max_tokens=5, extra_body=beam)
    assert [c.model_extra["token_ids"] for c in chat.choices] == [t for t, _ in hf_beams(hf, ids, [EOS], 1.0, 5, 2)]

    for extra, param in ((dict(stop=["x"]), "use_beam_search"), (dict(n=11), "n"),
                         (dict(prompt=list(range(MAX_LEN))), "prompt")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": NAME, "prompt": prompt, "max_tokens": 4, "stream": True, **extra},
                                      extra_body=beam)
        assert e.value.body["param"] == param, extra
