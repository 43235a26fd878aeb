"""vLLM's sleep mode (jaxserve/sleep_mode.py): an idle engine gives its device memory back between
an RL trainer's rollouts and takes it again without recompiling.

The oracles: transformers' greedy tokens on each seeded checkpoint (before sleep, after a level-1
wake, after a level-2 wake and new weights), the bytes of every live JAX array (they drop by at
least the weights and KV pools put away, and come back to the same count), the process's
compilation count (flat across wake and generate), and the server's answers through a real HTTP
client."""
import concurrent.futures
import os
import time

import jax
import numpy as np
import pytest
import requests

from jaxserve import LLM, SamplingParams, sleep_mode
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.engine_thread import EngineThread
from jaxserve.sleep_mode import EngineAsleep, live_device_bytes
from jaxserve.weight_update import checkpoint_tensors
from tests import server_harness
from tests.hf_models import hf_greedy, save_engine_model

NEW_TOKENS = 10
SP = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Checkpoints A and B (transformers models), prompts sharing a cached prefix, and an LLM on A
    with LoRA slots (weights that level 2 keeps too). Every generate schedules the same steps, so
    the jit compiles each step shape once: a compilation after a wake is one the wake caused."""
    tmp = tmp_path_factory.mktemp("sleep")
    a, b = (save_engine_model(str(tmp / name), seed=seed) for seed, name in enumerate("ab"))
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 24).tolist()
    prompts = [shared + rng.integers(0, 256, 3).tolist(), shared + rng.integers(0, 256, 5).tolist()]
    llm = LLM(model=str(tmp / "a"), max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=16,
              max_prefill_seqs=1, page_size=8, max_model_len=64, num_pages=24, enable_prefix_caching=True,
              compilation_cache_dir=None, enable_lora=True)
    want = {name: [hf_greedy(m, p, NEW_TOKENS)[0] for p in prompts] for name, m in (("a", a), ("b", b))}
    return llm, {name: str(tmp / name) for name in "ab"}, prompts, want


def _device_trees(engine) -> list:
    """The target's params and KV pools, then what level 2 keeps: a draft's (params, KV pools), the LoRA slots."""
    r, d = engine.runner, engine.draft and engine.draft.runner
    return [r.params, r.kv_cache, d and d.params, d and d.kv_cache, engine.loras and engine.loras.weights]


def _nbytes(trees) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(trees))


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]


def test_level_1_sleeps_and_wakes_up_to_the_same_tokens_without_compiling(setup):
    llm, _, prompts, want = setup
    engine = llm.llm_engine
    assert _tokens(llm, prompts) == want["a"] and engine.block_manager.num_cached_pages > 0
    trees = _device_trees(engine)
    lora = [np.asarray(x) for x in jax.tree.leaves(trees[4])]
    put_away, before = _nbytes(trees), sum(live_device_bytes().values())

    llm.sleep(level=1)
    assert llm.is_sleeping() and engine.block_manager.num_cached_pages == 0
    assert before - sum(live_device_bytes().values()) >= put_away
    assert all(x.is_deleted() for x in jax.tree.leaves(trees))
    with pytest.raises(EngineAsleep, match="weights and kv_cache put away"):
        llm.generate(prompts, SP, use_tqdm=False)
    with pytest.raises(EngineAsleep, match="tags=weights"):
        llm.load_weights([])
    with pytest.raises(ValueError, match="unknown sleep mode tag"):
        llm.wake_up(["activations"])

    compiles = CompileCounter.count
    llm.wake_up()
    assert not llm.is_sleeping() and sum(live_device_bytes().values()) == before
    assert _tokens(llm, prompts) == want["a"]
    assert CompileCounter.count == compiles
    restored = _device_trees(engine)
    for x, y in zip(lora, jax.tree.leaves(restored[4])):
        np.testing.assert_array_equal(x, np.asarray(y))
    assert [x.sharding for x in jax.tree.leaves(restored)] == [x.sharding for x in jax.tree.leaves(trees)]

    running = engine.add_request(prompts[0], SP)
    with pytest.raises(RuntimeError, match="1 request"):
        llm.sleep()
    engine.abort(running)
    with pytest.raises(ValueError, match="level must be 1"):
        llm.sleep(level=3)


def test_level_2_then_new_weights_before_the_kv_cache(setup):
    """The RL trainer's round: sleep(2) drops the weights; wake_up(["weights"]) gives zeroed
    buffers (the KV pools still asleep: no request yet) into which B's weights are loaded; then
    the KV cache wakes, and the tokens are B's."""
    llm, dirs, prompts, want = setup
    engine = llm.llm_engine
    put_away, before = _nbytes(_device_trees(engine)), sum(live_device_bytes().values())
    llm.sleep(level=2)
    assert before - sum(live_device_bytes().values()) >= put_away

    compiles = CompileCounter.count
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping() and engine.runner.kv_cache is None
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(engine.runner.params))   # dropped: zeros
    with pytest.raises(EngineAsleep, match="kv_cache put away"):
        llm.generate(prompts, SP, use_tqdm=False)
    llm.load_weights(checkpoint_tensors(dirs["b"]))
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and sum(live_device_bytes().values()) == before
    assert _tokens(llm, prompts) == want["b"]
    assert CompileCounter.count == compiles
    llm.load_weights(checkpoint_tensors(dirs["a"]))   # A again, for the test below


def test_level_2_keeps_a_draft_models_weights(setup):
    """Only the served model's weights are the trainer's to load: a draft model's stay on the
    host and come back as they were (no step runs here: nothing compiles)."""
    _, dirs, _, _ = setup
    engine = LLM(model=dirs["a"], max_model_len=64, num_pages=24, page_size=8, compilation_cache_dir=None,
                 speculative={"method": "draft", "model": dirs["b"], "num_tokens": 3}).llm_engine
    trees = _device_trees(engine)
    draft = [np.asarray(x) for x in jax.tree.leaves(trees[2])]
    put_away, before = _nbytes(trees), sum(live_device_bytes().values())
    sleep_mode.sleep(engine, level=2)
    assert before - sum(live_device_bytes().values()) >= put_away
    sleep_mode.wake_up(engine)
    assert sum(live_device_bytes().values()) == before
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(engine.runner.params))
    for x, y in zip(draft, jax.tree.leaves(engine.draft.runner.params)):
        np.testing.assert_array_equal(x, np.asarray(y))


def test_every_data_parallel_replica_sleeps(setup):
    """The server's sleep and wake_up run on every replica (two engines on this one device)."""
    _, dirs, prompts, want = setup
    engines = [LLMEngine(EngineConfig(model=dirs["a"], max_model_len=64, num_pages=24, page_size=8,
                                      compilation_cache_dir=None)) for _ in range(2)]
    client = DataParallelEngine([EngineThread(e) for e in engines]).start(warmup=False)
    try:
        client.when_idle(lambda engine: sleep_mode.sleep(engine, 1))
        assert [e.runner.params is None and e.runner.kv_cache is None for e in engines] == [True, True]
        client.when_idle(lambda engine: sleep_mode.wake_up(engine))
        assert not any(e.sleeping for e in engines)
        streams = [client.submit(p, SP) for p in prompts]   # one a replica
        assert [[t for o in s for c in o.outputs for t in c.token_ids] for s in streams] == want["a"]
    finally:
        client.shutdown()


def test_a_request_that_races_the_sleep_runs_once_the_engine_wakes(setup):
    """As the server sleeps: on the engine thread once the request before is done. One submitted
    just after (checked while the engine was awake) is held while it sleeps, then served; one
    submitted while it sleeps is refused."""
    llm, _, prompts, want = setup
    thread = EngineThread(llm.llm_engine).start(warmup=False)
    try:
        first = thread.submit(prompts[0], SP)
        asleep = thread.call_when_idle(lambda engine: sleep_mode.sleep(engine, 1))
        raced = thread.submit(prompts[1], SP)
        assert [t for o in first for c in o.outputs for t in c.token_ids] == want["a"][0]
        asleep.result(timeout=60)
        with pytest.raises(EngineAsleep):
            thread.submit(prompts[1], SP)
        time.sleep(0.2)
        assert thread.num_pending == 1   # held, not run on deleted buffers
        thread.when_idle(lambda engine: sleep_mode.wake_up(engine), timeout=60)
        assert [t for o in raced for c in o.outputs for t in c.token_ids] == want["a"][1]
    finally:
        thread.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The API tests' model and engine (test_server.py), whose executables their servers store."""
    a_dir, a, _ = server_harness.bytes_model(tmp_path_factory)
    workdir = tmp_path_factory.mktemp("sleep-server")
    for s in server_harness.serving(str(workdir), a_dir, "--enable-sleep-mode", "--allow-weight-updates",
                                    **server_harness.BYTES_ENGINE):
        yield s, a_dir, a


def test_server_sleeps_and_wakes_up(server):
    """POST /sleep waits for the request in flight, then requests get 503 until both tags are
    awake; a level-2 round with the weights loaded from disk between the two wake-ups serves
    transformers' tokens again, and nothing compiled meanwhile."""
    s, a_dir, a = server
    prompt = np.random.default_rng(1).integers(0, 256, 9).tolist()
    want = hf_greedy(a, prompt, NEW_TOKENS)[0]
    client = server_harness.openai_client(s)

    def complete(max_tokens: int = NEW_TOKENS) -> list[int]:
        out = client.completions.create(model=os.path.basename(a_dir), prompt=prompt, max_tokens=max_tokens,
                                        temperature=0.0, extra_body=dict(ignore_eos=True, return_token_ids=True))
        return out.choices[0].model_extra["token_ids"]

    def post(route: str, **params) -> requests.Response:
        return requests.post(s.url + route, params=params, timeout=120)

    def sleeping() -> bool:
        return requests.get(s.url + "/is_sleeping", timeout=30).json()["is_sleeping"]

    compiles = s.metrics()["jaxserve_xla_compilations_total"]
    assert not sleeping()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(complete, 400)
        while not s.metrics()["jaxserve_num_sequences_running"]:
            time.sleep(0.01)
        r = post("/sleep", level=1)
        assert r.status_code == 200 and r.json() == {"is_sleeping": True}, r.text
        tokens = running.result()   # whole: the sleep waited for it (on deleted buffers it would have failed)
        assert len(tokens) == 400 and tokens[:NEW_TOKENS] == want
    assert sleeping()
    r = requests.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and "sleeping" in r.json()["error"]["message"], r.text
    assert post("/wake_up").json() == {"is_sleeping": False}
    assert complete() == want

    assert post("/sleep", level=2).status_code == 200
    assert post("/wake_up", tags="weights").json() == {"is_sleeping": True}
    r = requests.post(s.url + "/update_weights_from_disk", json={"model_path": a_dir}, timeout=120)
    assert r.status_code == 200, r.text
    r = requests.post(s.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503, r.text
    assert post("/wake_up", tags="kv_cache").json() == {"is_sleeping": False}
    assert complete() == want
    assert s.metrics()["jaxserve_xla_compilations_total"] == compiles

    for route, params, param in [("/sleep", {"level": "3"}, "level"), ("/wake_up", {"tags": "memory"}, "tags")]:
        r = post(route, **params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not sleeping()


def test_sleep_mode_is_off_unless_asked_for(tmp_path):
    from jaxserve.config import EngineConfig
    from jaxserve.server.app import create_app

    client = create_app(EngineConfig(model=str(tmp_path))).test_client()   # no model there: it never loads
    for r in (client.post("/sleep?level=1"), client.post("/wake_up"), client.get("/is_sleeping")):
        assert r.status_code == 404 and "--enable-sleep-mode" in r.get_json()["error"]["message"]
