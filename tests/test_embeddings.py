"""Embeddings (jaxserve/pooling.py) against transformers' final hidden states: LLM.embed (MEAN
pooling over chunked prompts of a base model without LM head, with the prefix cache in play), /v1/embeddings through the openai
client (a sentence-transformers Qwen3 model: LAST pooling, normalized, Matryoshka dimensions,
base64), what each runner refuses, and the pooling sums over chunks and a preemption against numpy."""
import base64
import json
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer

from jaxserve import LLM, PoolingParams, SamplingParams, pooling
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import InvalidRequest
from jaxserve.scheduler import ScheduledSeq
from jaxserve.sequence import Sequence
from tests import server_harness
from tests.conftest import fake_devices_env
from tests.hf_models import save_byte_tokenizer, save_hf_model

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, 256, n).tolist() for n in (45, 3, 17, 1)]


def sentence_transformers_dir(path: str, mode: str | None, normalize: bool) -> None:
    """The files sentence-transformers saves beside the model: modules.json and the Pooling config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        os.makedirs(os.path.join(path, "1_Pooling"))
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": 64, **{m: m == mode for m in pooling.POOLING_TYPES}}, f)
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)


def hidden_states(model, prompt: list[int]) -> np.ndarray:
    """transformers' final hidden states [len, hidden] (after the final norm)."""
    with torch.no_grad():
        return model.model(torch.tensor([prompt])).last_hidden_state[0].numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3 embedding model as Qwen3-Embedding ships: LAST pooling, Normalize, Matryoshka."""
    path = str(tmp_path_factory.mktemp("qwen3_embedding"))
    model = save_hf_model("qwen3_qk_norm", path).eval()
    save_byte_tokenizer(path)
    sentence_transformers_dir(path, "pooling_mode_lasttoken", normalize=True)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "is_matryoshka": True}, f)
    return path, model


@pytest.fixture(scope="module")
def server(qwen3, tmp_path_factory):
    yield from server_harness.serving(str(tmp_path_factory.mktemp("served")), qwen3[0], "--served-model-name", "emb")


def test_embeddings_route_matches_transformers(server, qwen3):
    """Several inputs as token ids, in float and in base64 (the openai client's default):
    transformers' last hidden state, normalized; `dimensions` cuts before normalizing."""
    client = server_harness.openai_client(server)
    want = [unit(hidden_states(qwen3[1], p)[-1]) for p in PROMPTS]
    for fmt in ("float", "base64"):
        out = client.embeddings.create(model="emb", input=PROMPTS, encoding_format=fmt)
        assert [d.index for d in out.data] == list(range(len(PROMPTS)))
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, PROMPTS))
        for d, w in zip(out.data, want):
            vector = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else np.array(d.embedding)
            np.testing.assert_allclose(vector, w, atol=2e-4)
    cut = client.embeddings.create(model="emb", input=PROMPTS[0], dimensions=16, encoding_format="float")
    np.testing.assert_allclose(cut.data[0].embedding, unit(hidden_states(qwen3[1], PROMPTS[0])[-1, :16]), atol=2e-4)
    raw = requests.post(server.url + "/v1/embeddings", json={"input": PROMPTS[2], "normalize": False}).json()
    np.testing.assert_allclose(raw["data"][0]["embedding"], hidden_states(qwen3[1], PROMPTS[2])[-1], atol=2e-4)


def test_embeddings_of_a_conversation_match_transformers(server, qwen3):
    """vLLM's `messages` instead of `input`: the conversation as transformers' tokenizer renders
    it with the chat template, without a generation prompt (with one if asked), embedded as
    transformers does; `input` and `messages` together are a 400."""
    tok = AutoTokenizer.from_pretrained(qwen3[0])
    conversation = [{"role": "user", "content": "What is a page?"}, {"role": "assistant", "content": "A block."}]
    for start in (False, True):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=start, tokenize=True, return_dict=False)
        body = {"messages": conversation, **({"add_generation_prompt": True} if start else {})}
        out = requests.post(server.url + "/v1/embeddings", json=body, timeout=120).json()
        assert out["usage"]["prompt_tokens"] == len(ids)
        np.testing.assert_allclose(out["data"][0]["embedding"], unit(hidden_states(qwen3[1], ids)[-1]), atol=2e-4)
    r = requests.post(server.url + "/v1/embeddings", json={"messages": conversation, "input": "x"}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),
    ({"input": "x" * 600}, "input"),                      # longer than max_model_len (128)
    ({"input": "hi", "model": "other"}, "model"),
])
def test_embeddings_route_refuses_bad_input(server, body, param):
    r = requests.post(server.url + "/v1/embeddings", json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_pooling_server_refuses_generation(server):
    with pytest.raises(openai.BadRequestError, match="serves embeddings"):
        server_harness.openai_client(server).completions.create(model="emb", prompt=[1, 2, 3], max_tokens=2)
    assert requests.get(server.url + "/health").status_code == 200


def base_model_dir(path: str, model) -> str:
    """`model`'s transformer saved alone, as e5-mistral ships: architecture MistralModel, tensors
    without the "model." prefix, no LM head (and tie_word_embeddings false)."""
    model.model.save_pretrained(path)
    save_byte_tokenizer(path)
    return path


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = dict(max_model_len=128, page_size=8, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16,
              max_prefill_seqs=2, compilation_cache_dir=None, step_shapes="largest")


@pytest.fixture(scope="module")
def mean_llm(tmp_path_factory):
    """A base Mistral (12-token window) with MEAN pooling and no Normalize; chunks of 16 tokens,
    so prompts span steps."""
    model = save_hf_model("mistral_window", str(tmp_path_factory.mktemp("mistral"))).eval()
    path = base_model_dir(str(tmp_path_factory.mktemp("mistral_mean")), model)
    sentence_transformers_dir(path, "pooling_mode_mean_tokens", normalize=False)
    return LLM(path, **ENGINE), model


def test_base_model_defaults_to_last_token_pooling(mean_llm, tmp_path):
    """A base-model architecture without sentence-transformers files: runner auto pools (LAST,
    normalized), its missing LM head tied to the embeddings."""
    path = base_model_dir(str(tmp_path), mean_llm[1])
    ecfg, cfg, pooler = pooling.configure(EngineConfig(runner="auto", model=path), path)
    assert (cfg.architecture, ecfg.runner, pooler, cfg.tie_word_embeddings) == (
        "MistralModel", "pooling", pooling.Pooler("LAST", True, None), True)


def test_mean_pooling_over_chunks_matches_transformers(mean_llm):
    """MEAN over prompts of 1 to 45 tokens (up to 3 chunks), twice: the second time their pages
    are in the prefix cache, which a MEAN request must not use (cached pages have no hidden states)."""
    llm, model = mean_llm
    assert llm.llm_engine.ecfg.runner == "pooling"
    want = [hidden_states(model, p).mean(0) for p in PROMPTS]
    for _ in range(2):
        for out, w in zip(llm.embed(PROMPTS, use_tqdm=False), want):
            np.testing.assert_allclose(out.outputs.embedding, w, atol=2e-4)
    normalized = llm.embed(PROMPTS[0], PoolingParams(normalize=True, truncate_prompt_tokens=20), use_tqdm=False)
    np.testing.assert_allclose(normalized[0].outputs.embedding, unit(hidden_states(model, PROMPTS[0][-20:]).mean(0)),
                               atol=2e-4)


def test_tensor_and_sequence_parallel_embeddings_match_one_device(mean_llm):
    """MEAN embeddings at TP 2 and with sequence-parallel prefill over 2 (each chunk pooled from
    its hidden states split over "seq"; fake CPU devices, in a subprocess: this file's main)
    equal one device's."""
    llm, _ = mean_llm
    proc = subprocess.run([sys.executable, "-m", "tests.test_embeddings", llm.llm_engine.model_dir], cwd=ROOT,
                          capture_output=True, text=True, env=fake_devices_env(2), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one_device = [o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]
    for mesh, got in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        np.testing.assert_allclose(got, one_device, atol=1e-5, err_msg=mesh)


def test_runners_refuse_each_others_requests(mean_llm):
    llm, _ = mean_llm
    with pytest.raises(InvalidRequest, match="serves embeddings"):
        llm.generate([1, 2], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="Matryoshka"):
        llm.embed([1, 2], PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(InvalidRequest, match="does not serve embeddings"):
        LLM(None, runner="generate", max_model_len=64, max_num_seqs=2, compilation_cache_dir=None,
            max_num_batched_tokens=16).embed([1, 2], use_tqdm=False)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_pooling_sums_over_chunks_and_a_preemption(kind):
    """pack -> compute -> accumulate over a schedule of chunks, one sequence preempted after two
    chunks and recomputed whole: each embedding is numpy's pooling of the sequence's rows."""
    hidden = {n: RNG.standard_normal((n, 8)).astype(np.float32) for n in (10, 3)}
    seqs = {n: Sequence(request_id=str(n), prompt_token_ids=[0] * n,
                        pooling=pooling.Pooled(kind, PoolingParams(), normalize=False)) for n in hidden}
    # steps of (sequence, chunk start, chunk length); sequence 10 preempted after [0, 8), then [0, 10)
    schedule = [[(10, 0, 4), (3, 0, 3)], [(10, 4, 4)], [(10, 0, 10)]]
    for step in schedule:
        rows, cursor, step_hidden = [], 0, np.zeros((16, 8), np.float32)
        for n, start, length in step:
            seqs[n].num_computed_tokens = start
            rows.append((ScheduledSeq(seqs[n], length, 0), cursor))
            step_hidden[cursor:cursor + length] = hidden[n][start:start + length]
            cursor += length
        packed = pooling.pack(rows, 16, num_segments=4)
        if packed is not None:
            pooling.accumulate(packed[0], pooling.compute(step_hidden, *packed[1], num_segments=4))
    for n, h in hidden.items():
        want = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
        np.testing.assert_allclose(seqs[n].pooling.result(n), want, atol=1e-5)


if __name__ == "__main__":   # the TP 2 and SP 2 runs, on the fake devices of this process
    print(json.dumps({axis: [o.outputs.embedding for o in LLM(sys.argv[1], mesh={axis: 2}, **ENGINE).embed(
        PROMPTS, use_tqdm=False)] for axis in ("model", "seq")}))
