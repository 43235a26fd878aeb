"""The `jaxserve` command as a process: a server's life (warm-up 503, API key, model name, 429 on a
full queue, SIGTERM drain and exit 0), and `convert` + `generate` against transformers."""
import concurrent.futures
import os
import signal
import subprocess
import sys
import time

import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer, GenerationConfig

from tests.hf_models import save_engine_model
from tests.server_harness import BYTES_ENGINE, BYTES_MODEL, TEST_ENGINE, ServerProcess

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # The API tests' model and server settings (their executables are built once), at a path of its own:
    # the served model's name is the directory's.
    path = str(tmp_path_factory.mktemp("models") / "tiny-test-model")
    hf = save_engine_model(path, **BYTES_MODEL)
    # Recommended settings in generation_config.json: greedy (top_k 1), whatever the temperature.
    GenerationConfig(do_sample=True, top_k=1, temperature=0.7).save_pretrained(path)
    return path, hf, AutoTokenizer.from_pretrained(path)


def complete(url, **body):
    return requests.post(url + "/v1/completions", json={"prompt": "hi", **body}, headers=AUTH, timeout=300)


def test_server_lifecycle(model, tmp_path):
    server = ServerProcess(tmp_path, model[0], "--api-key", KEY, **{**BYTES_ENGINE, "max_queue_size": 2})
    try:
        _lifecycle(server)
    finally:
        if server.proc.poll() is None:
            server.stop()


def _lifecycle(server):
    url = server.url
    seen = server.wait_ready()
    assert 503 in seen, seen    # /health said "warming up" before it said ready

    # API key: required everywhere but the probes.
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = requests.post(url + "/v1/completions", json={"prompt": "hi"}, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert requests.get(url + "/health", timeout=60).status_code == 200
    assert "jaxserve_kv_cache_usage_ratio" in requests.get(url + "/metrics", timeout=60).text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    assert [m.id for m in client.models.list().data] == ["tiny-test-model"]   # the directory's name
    assert client.completions.create(model="tiny-test-model", prompt="hi", max_tokens=3).usage.completion_tokens == 3

    # generation_config.json's settings are the defaults of requests that leave them out (top_k 1:
    # greedy), as in vLLM; a request's own value wins.
    def text(**kw):
        return client.completions.create(model="tiny-test-model", prompt="The", max_tokens=12, seed=3,
                                         extra_body={"ignore_eos": True, **kw}).choices[0].text
    assert text() == text(temperature=0) != text(top_k=0, temperature=1.5)
    assert "generation_config.json: {'temperature': 0.7, 'top_k': 1}" in server.log_tail(10**6)

    # A burst larger than max_num_seqs + max_queue_size: the overflow gets 429, the rest completes.
    long_request = dict(max_tokens=100, ignore_eos=True, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        burst = list(pool.map(lambda _: complete(url, **long_request), range(40)))
    codes = [r.status_code for r in burst]
    # Every slot (running + queued) is taken before the first of these finishes, unless a slow
    # machine spreads the burst out: then more get through, never fewer.
    assert codes.count(200) >= TEST_ENGINE["max_num_seqs"] + 2 and set(codes) == {200, 429}, codes
    assert all(r.json()["error"]["type"] == "rate_limit_error" for r in burst if r.status_code == 429)
    assert all(r.json()["usage"]["completion_tokens"] == 100 for r in burst if r.status_code == 200)

    # SIGTERM with requests in flight: they all finish, new connections are refused, exit 0.
    streams = []
    for i in range(TEST_ENGINE["max_num_seqs"]):
        r = requests.post(url + "/v1/completions", json={"prompt": f"p{i}", "stream": True, **long_request},
                          headers=AUTH, stream=True, timeout=300)
        lines = r.iter_lines()
        assert next(lines).startswith(b"data: ")   # running
        streams.append(lines)
    server.proc.send_signal(signal.SIGTERM)
    with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
        tails = pool.map(lambda lines: [line for line in lines if line][-2:], streams)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:   # the listening socket closes at once
            try:
                assert requests.get(url + "/health", timeout=5).status_code in (200, 503)
            except requests.ConnectionError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("still accepting connections 30 s after SIGTERM")
        tails = list(tails)
    assert server.proc.wait(120) == 0, server.log_tail()
    for last, done in tails:
        assert done == b"data: [DONE]" and b'"finish_reason":"length"' in last
    log = server.log_tail(10**6)
    assert log.count("finish=length") == codes.count(200) + len(streams) + 4   # one line per request
    after_signal = log[log.index("SIGTERM: draining"):]
    assert after_signal.count("finish=length") >= 1, "no request was in flight at SIGTERM"


def test_convert_then_generate(model, tmp_path):
    """`jaxserve convert` writes an orbax checkpoint; `jaxserve generate` from it prints the greedy
    continuation that transformers computes from the original safetensors. Run as a user would,
    without JAX_PLATFORMS: the installed TPU and CUDA compiler plugins must not spill errors."""
    path, hf, tok = model
    prompt = "The quick brown fox"
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    config = tmp_path / "engine.yaml"
    config.write_text("\n".join(f"{k}: {v}" for k, v in TEST_ENGINE.items()))
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"PYTHONIOENCODING": "utf-8"}
    jaxserve = [sys.executable, "-m", "jaxserve.cli"]
    orbax_dir = str(tmp_path / "orbax")
    subprocess.run([*jaxserve, "convert", path, orbax_dir], check=True, env=env, capture_output=True, timeout=600)
    out = subprocess.run([*jaxserve, "generate", "--model", orbax_dir, "--config", str(config), "--prompt", prompt,
                          "--max-tokens", "8"], check=True, env=env, capture_output=True, timeout=600)
    if tok.eos_token_id in ref:   # generate stops at eos, as the server does by default
        ref = ref[:ref.index(tok.eos_token_id)]
    assert out.stdout.decode("utf-8") == tok.decode(ref) + "\n"
    errors = out.stderr.decode("utf-8", "replace")
    assert "Traceback" not in errors and "TPU_WORKER_HOSTNAMES" not in errors, errors
