"""The OpenAI server's LoRA adapters (jaxserve/lora.py, jaxserve/server/host.py) against
transformers + peft, as tests/test_lora.py checks the engine: an adapter selected by `model`,
vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (refusals, a request running on while
its adapter is unloaded, one slot shared by turns) and their switch."""
import json
import shutil
import threading
import time

import numpy as np
import openai
import pytest
import requests

from tests import server_harness
from tests.hf_models import save_byte_tokenizer, save_hf_model
from tests.test_lora import ADAPTERS, NEW_TOKENS, reference, save_adapter

PROMPT = np.random.default_rng(0).integers(0, 256, 19).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base model; test_lora's a1 and a2, and a4 (within a2's targets, for loading at
    runtime); greedy tokens for PROMPT by transformers (+ peft) for the base model, a2 and a4."""
    base = str(tmp_path_factory.mktemp("base"))
    expected = {None: reference(save_hf_model("llama_gqa_rope3", base).eval(), PROMPT)[0]}
    save_byte_tokenizer(base)
    dirs = {}
    for name, (seed, config) in {"a1": ADAPTERS["a1"], "a2": ADAPTERS["a2"],
                                 "a4": (6, dict(r=8, lora_alpha=16, target_modules=["q_proj", "down_proj"]))}.items():
        dirs[name] = str(tmp_path_factory.mktemp(name))
        model = save_adapter(base, dirs[name], seed, **config)
        if name != "a1":   # (a1 is only refused: it targets more than a2)
            expected[name] = reference(model, PROMPT)[0]
    return base, dirs, expected


@pytest.fixture(scope="module")
def server(setup, tmp_path_factory):
    """a2 served from the start, in one slot (max_loras 1); adapters may be loaded at runtime."""
    base, dirs, _ = setup
    yield from server_harness.serving(str(tmp_path_factory.mktemp("served")), base, "--served-model-name", "base",
                                      "--allow-runtime-lora-updating", lora_modules={"a2": dirs["a2"]})


def complete(client, model: str, prompt: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                    extra_body=dict(ignore_eos=True, return_token_ids=True))
    assert out.model == model
    return out.choices[0].model_extra["token_ids"]


def test_served_adapter_by_model_name(setup, server):
    """The OpenAI client's `model` picks the adapter (or the base model); /v1/models lists the
    adapter with its parent; an unknown model is a 404 model_not_found."""
    _, dirs, expected = setup
    client = server_harness.openai_client(server)
    cards = client.models.list().data
    assert [(m.id, m.model_extra["parent"]) for m in cards] == [("base", None), ("a2", "base")]
    assert client.models.retrieve("a2").model_extra["root"] == dirs["a2"]
    for model, name in (("a2", "a2"), ("base", None)):
        assert complete(client, model, PROMPT) == expected[name], model
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="a1", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "'base', 'a2'" in e.value.message


def test_runtime_load_and_unload(setup, server, tmp_path):
    """/v1/load_lora_adapter refuses what the engine cannot serve (4xx, OpenAI's error shape);
    a4 loaded is listed and selected by `model`. With one slot, a4's request waits for a2's long
    one to end, and a4 unloaded meanwhile: the request runs on and equals peft's, new ones are
    404s, and the server's log shows the order."""
    base, dirs, expected = setup
    path = dirs["a4"]
    client = server_harness.openai_client(server)

    def post(route: str, **body) -> requests.Response:
        return requests.post(f"{server.url}/v1/{route}", json=body, timeout=120)

    rank_32 = shutil.copytree(dirs["a2"], tmp_path / "rank32")
    config = json.loads((rank_32 / "adapter_config.json").read_text())
    (rank_32 / "adapter_config.json").write_text(json.dumps({**config, "r": 32}))
    refusals = [("load", dict(lora_name="a4"), 400, "both 'lora_name' and 'lora_path' are required"),
                ("load", dict(lora_name="a4", lora_path=str(tmp_path / "nowhere")), 400, "no adapter_config.json"),
                ("load", dict(lora_name="a4", lora_path=str(tmp_path)), 400, "no adapter_config.json"),
                ("load", dict(lora_name="a4", lora_path=dirs["a1"]), 400, "targets model/layers_0/mlp/gate_proj"),
                ("load", dict(lora_name="a4", lora_path=str(rank_32)), 400, "rank 32 is above max_lora_rank 16"),
                ("load", dict(lora_name="a2", lora_path=path), 400, "'a2' has already been loaded"),
                ("unload", dict(lora_name="a4"), 404, "'a4' cannot be found")]
    for route, body, status, message in refusals:
        r = post(f"{route}_lora_adapter", **body)
        assert r.status_code == status and message in r.json()["error"]["message"], (body, r.text)

    for _ in range(3):   # again if a busy machine ran a2 and a4 to their ends before the unload
        r = post("load_lora_adapter", lora_name="a4", lora_path=path)
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a4' added successfully.")
        cards = [(m.id, m.model_extra["root"], m.model_extra["parent"]) for m in client.models.list().data]
        assert cards == [("base", base, None), ("a2", dirs["a2"], "base"), ("a4", path, "base")]
        long_a2 = client.completions.create(model="a2", prompt=PROMPT, max_tokens=96, temperature=0.0, stream=True,
                                            extra_body=dict(ignore_eos=True, return_token_ids=True))
        streamed = [next(iter(long_a2))]   # a2 runs, holding the one slot
        a4 = []
        thread = threading.Thread(target=lambda: a4.append(client.completions.create(
            model="a4", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0,
            extra_body=dict(ignore_eos=True, return_token_ids=True))))
        thread.start()
        while not a4 and server.metrics()["jaxserve_num_sequences_waiting"] == 0:   # a4's request, in the engine
            time.sleep(0.01)
        r = post("unload_lora_adapter", lora_name="a4")
        assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'a4' removed successfully.")
        with pytest.raises(openai.NotFoundError):
            complete(client, "a4", PROMPT)
        assert [m.id for m in client.models.list().data] == ["base", "a2"]
        streamed += list(long_a2)
        thread.join()
        tokens = [t for chunk in streamed for t in chunk.choices[0].model_extra["token_ids"]]
        assert len(tokens) == 96 and tokens[:NEW_TOKENS] == expected["a2"]
        assert a4[0].choices[0].model_extra["token_ids"] == expected["a4"]
        log = server.log_tail(10**7)
        finished = {name: log.index(f"{request_id}-0 prompt_tokens=") for name, request_id in
                    (("a2", streamed[0].id), ("a4", a4[0].id))}
        assert finished["a2"] < finished["a4"]
        if log.rindex("unloaded LoRA adapter a4") < finished["a4"]:
            return
    pytest.fail("a4's request finished before its adapter was unloaded, 3 times")

def test_runtime_updating_is_off_unless_asked_for(monkeypatch, tmp_path):
    """--allow-runtime-lora-updating, or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING, turns the load and
    unload routes on; off, they are 404s (vLLM has no such routes then)."""
    from jaxserve import cli
    from jaxserve.config import EngineConfig
    from jaxserve.server.app import create_app

    def allowed(*flags: str) -> bool:
        args = cli.build_parser().parse_args(["serve", "--enable-lora", *flags])
        return cli.engine_config(args).allow_runtime_lora_updating

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert (allowed(), allowed("--allow-runtime-lora-updating")) == (False, True)
    for value, on in (("True", True), ("1", True), ("0", False), ("false", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert allowed() == on, value
    app = create_app(EngineConfig(model=str(tmp_path), enable_lora=True))   # no model there: it never loads
    for route in ("load", "unload"):
        r = app.test_client().post(f"/v1/{route}_lora_adapter", json={"lora_name": "x", "lora_path": "/x"})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.get_json()["error"]["message"]
