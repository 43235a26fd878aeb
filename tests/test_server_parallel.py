"""`jaxserve serve` scaled out, end to end over HTTP: data-parallel replicas (--dp) in one process,
and one tensor-parallel engine over two processes (multi-host flags, CPU gloo collectives).
Completions are checked against transformers' greedy tokens."""
import concurrent.futures

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.conftest import fake_devices_env
from tests.hf_models import save_engine_model
from tests.server_harness import ServerProcess, free_port

# Few buckets (2 decode shapes, 1 prefill shape): a small warm-up per replica / process.
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=16)
PROMPTS = ["a", "The quick brown fox", "jumps over the lazy dog, again and again and again", "xyz 123"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("model"))
    hf = save_engine_model(path, vocab_size=258)
    return path, hf, AutoTokenizer.from_pretrained(path)


def hf_greedy_text(hf, tok, prompt: str) -> str:
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return tok.decode(ids[-MAX_TOKENS:])


def complete_all(url: str) -> list[str]:
    """All PROMPTS at once (concurrent requests), greedy."""
    def one(prompt):
        r = requests.post(url + "/v1/completions", timeout=300, json=dict(
            prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_data_parallel_server(model, tmp_path, monkeypatch):
    path, hf, tok = model
    monkeypatch.setenv("XLA_FLAGS", fake_devices_env(8)["XLA_FLAGS"])
    server = ServerProcess(tmp_path, path, "--dp", "2", "--tp", "2", **ENGINE)
    try:
        server.wait_ready()
        assert complete_all(server.url) == [hf_greedy_text(hf, tok, p) for p in PROMPTS]
        m = server.metrics()   # summed over the replicas
        assert m["jaxserve_generation_tokens_total"] == MAX_TOKENS * len(PROMPTS)
        assert m["jaxserve_prompt_tokens_total"] == sum(len(tok.encode(p, add_special_tokens=False))
                                                        for p in PROMPTS)
    finally:
        assert server.stop() == 0, server.log_tail()
    assert "2 replica(s)" in server.log_tail(10**6)


def test_multihost_server(model, tmp_path, monkeypatch):
    """Two `jaxserve serve` processes (2 CPU devices each, TP 4): process 0 serves HTTP, process 1
    follows; after SIGTERM both exit 0."""
    path, hf, tok = model
    monkeypatch.setenv("XLA_FLAGS", fake_devices_env(2)["XLA_FLAGS"])
    address = f"127.0.0.1:{free_port()}"
    for i in range(2):
        (tmp_path / str(i)).mkdir()
    procs = [ServerProcess(tmp_path / str(i), path, "--tp", "4", "--coordinator-address", address,
                           "--num-processes", "2", "--process-id", str(i), **ENGINE) for i in range(2)]
    leader, follower = procs
    try:
        leader.wait_ready()
        with pytest.raises(requests.ConnectionError):   # the follower serves no HTTP
            requests.get(follower.url + "/health", timeout=5)
        want = [hf_greedy_text(hf, tok, p) for p in PROMPTS]
        assert complete_all(leader.url) == want
        assert complete_all(leader.url) == want   # again, after the engine idled in between
        assert leader.stop() == 0, leader.log_tail()
        assert follower.proc.wait(60) == 0, follower.log_tail()
    finally:
        for p in procs:
            p.stop()
    assert "following process 0" in follower.log_tail(10**6)
