"""`jaxserve run-batch` (jaxserve/run_batch.py), end to end in a subprocess on the API tests'
byte-level model and engine (their executables, loaded): OpenAI Batch lines answered in input
order, the texts transformers' greedy continuations, bad lines and refused requests reported per
line while the rest are answered."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from jaxserve import run_batch
from tests.hf_models import hf_greedy
from tests.server_harness import BYTES_ENGINE, TEST_ENGINE, bytes_model, store_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("line, custom_id, says", [
    ('{"custom_id": "broken", ', None, "not JSON"),
    ('[1, 2]', None, "JSON object"),
    ('{"custom_id": 7, "url": "/v1/completions", "body": {}}', 7, "custom_id"),
    ('{"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}', "get", "POST"),
    ('{"custom_id": "b", "url": "/v1/completions", "body": []}', "b", "body"),
    ('{"custom_id": "s", "url": "/v1/completions", "body": {"stream": true}}', "s", "stream"),
])
def test_a_bad_line_is_parsed_once_and_keeps_its_custom_id(monkeypatch, line, custom_id, says):
    parsed = []
    monkeypatch.setattr(run_batch.json, "loads", lambda s, loads=json.loads: parsed.append(s) or loads(s))
    with pytest.raises(run_batch.BadLine, match=says) as e:
        run_batch.request_of(line)
    assert e.value.custom_id == custom_id and parsed == [line]


def test_run_batch_answers_every_line_in_order(tmp_path_factory):
    model_dir, hf, tok = bytes_model(tmp_path_factory)
    work = tmp_path_factory.mktemp("run_batch")
    settings = {**TEST_ENGINE, **BYTES_ENGINE}
    (work / "engine.yaml").write_text(yaml.safe_dump({**settings, "compilation_cache_dir": store_of(settings)}))
    chat = {"model": "bytes", "messages": [{"role": "user", "content": "héllo ✓"}], "max_tokens": 9,
            "temperature": 0, "ignore_eos": True}
    prompts = ["The cat", "1, 2, 3,", "zz"]
    lines = [json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat})]
    lines += [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "bytes", "prompt": p, "max_tokens": 7, "temperature": 0, "ignore_eos": True}})
              for i, p in enumerate(prompts)]
    lines += ['{"custom_id": "broken", ', "",   # not JSON: no custom_id to give back
              json.dumps({"custom_id": "neg", "url": "/v1/completions", "body": {"model": "bytes", "prompt": "a",
                                                                                  "max_tokens": -1}}),
              json.dumps({"custom_id": "stream", "url": "/v1/completions", "body": {"prompt": "a", "stream": True}}),
              json.dumps({"custom_id": "nowhere", "url": "/v1/nowhere", "body": {}}),
              json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}})]
    (work / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "jaxserve.cli", "run-batch", "--model", model_dir,
                           "--config", str(work / "engine.yaml"), "--served-model-name", "bytes",
                           "-i", str(work / "in.jsonl"), "-o", str(work / "out.jsonl")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in (work / "out.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "c0", "c1", "c2", None, "neg", "stream", "nowhere", "get"]
    assert len({o["id"] for o in out}) == len(out)

    # tests/hf_models.py's chat template, written out
    prompt = tok.encode("user: héllo ✓\nassistant:", add_special_tokens=False)
    answer = out[0]["response"]
    assert answer["status_code"] == 200 and answer["request_id"] == answer["body"]["id"] and out[0]["error"] is None
    assert answer["body"]["choices"][0]["message"]["content"] == tok.decode(hf_greedy(hf, prompt, 9)[0])
    for o, p in zip(out[1:4], prompts):
        body = o["response"]["body"]
        assert body["choices"][0]["text"] == tok.decode(hf_greedy(hf, tok.encode(p, add_special_tokens=False), 7)[0],
                                                    skip_special_tokens=True)

    assert out[4]["response"] is None and out[4]["error"]["code"] == "invalid_request"
    neg = out[5]["response"]
    assert neg["status_code"] == 400 and neg["body"]["error"]["param"] == "max_tokens"
    assert out[6]["response"] is None and "stream" in out[6]["error"]["message"]
    assert out[7]["response"]["status_code"] == 404
    assert out[8]["response"] is None and "POST" in out[8]["error"]["message"]
