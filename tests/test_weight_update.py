"""New weights into a running engine (jaxserve/weight_update.py), as an RL trainer loads them
between rollouts: by Hugging Face tensor names, from torch, numpy or JAX arrays.

The oracles: transformers' greedy tokens on the new checkpoint (through the engine, no
recompilation, its prefix cache forgotten), and the params the checkpoint loader reads from the
new checkpoint (leaf for leaf, fused tensors, stacked experts, quantized Linears and a quantized
tied head among them)."""
import concurrent.futures
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
import torch
from safetensors.numpy import load_file

import jax
from jaxserve import LLM, SamplingParams, weight_update
from jaxserve.block_manager import BlockManager
from jaxserve.checkpoint import load_for_mesh, resolve_dtype
from jaxserve.compilations import CompileCounter
from jaxserve.config import ModelConfig
from jaxserve.engine_thread import EngineThread
from jaxserve.parallel import make_mesh
from jaxserve.sequence import Sequence
from tests import server_harness
from tests.conftest import fake_devices_env
from tests.hf_models import hf_greedy, save_engine_model, save_hf_model
from tests.test_scoring import DOCUMENTS, ENGINE as SCORING_ENGINE, hf_logits, save_classifier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_TOKENS = 12


def _state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.state_dict().items())


def test_engine_serves_the_new_weights_without_recompiling(tmp_path):
    """An engine on checkpoint A, its prefix cache holding a shared prefix's pages, given
    checkpoint B's tensors: its greedy tokens are transformers' on B. Had the cache kept A's
    pages, the second prompt would continue from A's K/V of the prefix."""
    save_engine_model(str(tmp_path / "a"), seed=0)
    b = save_engine_model(str(tmp_path / "b"), seed=1)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, 40).tolist()
    prompts = [shared + rng.integers(0, 256, 3).tolist(), shared + rng.integers(0, 256, 5).tolist()]
    llm = LLM(model=str(tmp_path / "a"), max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=16,
              max_prefill_seqs=1, page_size=8, max_model_len=96, num_pages=32, enable_prefix_caching=True,
              compilation_cache_dir=None)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert llm.llm_engine.block_manager.num_cached_pages >= 5   # the shared prefix, cached

    assert llm.load_weights(_state(b)) == len(b.state_dict())
    compiles = CompileCounter.count
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert CompileCounter.count == compiles
    want = [hf_greedy(b, p, NEW_TOKENS)[0] for p in prompts]
    assert after == want and before != want

    running = llm.llm_engine.add_request(prompts[0], sp)
    with pytest.raises(RuntimeError, match="1 request"):
        weight_update.update_engine(llm.llm_engine, _state(b))
    llm.llm_engine.abort(running)

    # As the server updates: on the engine thread once the requests before are done, the ones after held.
    thread, finished = EngineThread(llm.llm_engine).start(warmup=False), []
    thread.step_listeners.append(lambda outs, _: finished.extend(o.request_id for o in outs if o.finished))
    try:
        before = thread.submit(prompts[0], sp)
        update = thread.call_when_idle(lambda engine: finished.append(weight_update.update_engine(engine, _state(b))))
        after = thread.submit(prompts[1], sp)
        assert [len(list(s)) > 0 for s in (before, after)] == [True, True] and update.result() is None
        assert finished == [before.request_id, len(b.state_dict()), after.request_id]
    finally:
        thread.shutdown()


CASES = [("phi3_fused", "int8", False),       # qkv_proj and gate_up_proj feed three and two params
         ("qwen2_bias_tied", "w8a8", True),   # biases beside quantized Linears; the tied head's quantized copy
         ("qwen3_moe", None, False),          # each expert's tensors into its slice of the stacked params
         ("gpt2_conv1d", None, False),        # Conv1D weights, [in, out], transposed into place
         ("gpt_oss", None, False)]            # fused experts, [E, in, out]: transposed, gate/up de-interleaved


def compare_with_the_loader(tmp: str, name: str, quantization: str | None, lm_head: bool, mesh_shape: dict,
                            jax_arrays: bool = False) -> None:
    """Params of checkpoint A given B's tensors (read from its safetensors file; numpy, or JAX
    arrays on the first device as a trainer's would be) equal the loader's params of B, leaf for
    leaf and placement for placement."""
    dirs = [os.path.join(tmp, f"{name}-{s}") for s in "ab"]
    for seed, d in enumerate(dirs):
        save_hf_model(name, d, seed=seed)
    cfg = ModelConfig.from_pretrained(dirs[0])
    mesh, dtype = make_mesh(mesh_shape), resolve_dtype("float32")
    params = load_for_mesh(dirs[0], cfg, dtype, quantization, mesh, lm_head)
    want = load_for_mesh(dirs[1], cfg, dtype, quantization, mesh, lm_head)
    weights = list(load_file(os.path.join(dirs[1], "model.safetensors")).items())   # as the checkpoint names them
    weights = [(k, jax.device_put(v) if jax_arrays else v) for k, v in weights]
    weight_update.load_weights(params, weights, cfg, dtype, quantization)

    got, expected = jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in got] == [p for p, _ in expected]
    for (path, x), (_, y) in zip(got, expected):
        assert x.dtype == y.dtype and x.sharding == y.sharding, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name,quantization,lm_head", CASES)
def test_loaded_params_equal_the_loaders(tmp_path, name, quantization, lm_head):
    compare_with_the_loader(str(tmp_path), name, quantization, lm_head, {})


def test_loaded_params_equal_the_loaders_under_tensor_parallelism(tmp_path):
    """The same at TP 2 (fake CPU devices, in a subprocess), from JAX arrays: each new leaf split
    as the one it replaces."""
    subprocess.run([sys.executable, "-m", "tests.test_weight_update", str(tmp_path)], check=True, cwd=ROOT,
                   env=fake_devices_env(2), timeout=300)


def test_a_classifiers_new_head_classifies(tmp_path):
    """A sequence classifier's score head is applied on the host (jaxserve/pooling.py): given new
    tensors, head included, LLM.classify gives transformers' probabilities of the new model."""
    model = save_classifier("llama_gqa_rope3", str(tmp_path), ["negative", "neutral", "positive"])
    llm = LLM(str(tmp_path), **SCORING_ENGINE)
    ids = llm.get_tokenizer().encode(DOCUMENTS[0])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    logits = hf_logits(model, ids)
    probs = np.exp(logits) / np.exp(logits).sum()
    assert not np.allclose(llm.classify([ids], use_tqdm=False)[0].outputs.probs, probs, atol=1e-3)
    assert llm.load_weights(_state(model)) == len(model.state_dict())
    np.testing.assert_allclose(llm.classify([ids], use_tqdm=False)[0].outputs.probs, probs, atol=1e-5)


def test_a_bad_update_changes_nothing(tmp_path):
    """Unknown names and wrong shapes are refused before any leaf is replaced."""
    a = save_engine_model(str(tmp_path / "a"), seed=0)
    cfg = ModelConfig.from_pretrained(str(tmp_path / "a"))
    dtype = resolve_dtype("float32")
    params = load_for_mesh(str(tmp_path / "a"), cfg, dtype, None, make_mesh({}))
    leaves = jax.tree.leaves(params)
    good = [(k, np.zeros(v.shape, np.float32)) for k, v in a.state_dict().items()]
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_projection.weight"):
        weight_update.load_weights(params, good + [("model.layers.0.mlp.gate_projection.weight", good[0][1])],
                                   cfg, dtype, None)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(258, 32\), expected \(258, 64\)"):
        weight_update.load_weights(params, good[:-1] + [("lm_head.weight", np.zeros((258, 32)))], cfg, dtype, None)
    assert all(x is y for x, y in zip(jax.tree.leaves(params), leaves))


def test_reset_prefix_cache_forgets_cached_pages_only_when_none_is_in_use():
    bm = BlockManager(num_pages=8, page_size=4)
    tokens = list(range(12))
    seq = Sequence(request_id=0, prompt_token_ids=tokens)
    assert bm.admit(seq, bm.match_prefix(tokens), 12)
    seq.num_computed_tokens = 12
    bm.cache_full_pages(seq, 12)
    assert not bm.reset_prefix_cache()   # pages in use: nothing forgotten
    bm.free(seq)
    assert bm.num_cached_pages == 3 and len(bm.match_prefix(tokens)[0]) == 2   # the last token stays to compute
    assert bm.reset_prefix_cache()
    assert bm.num_cached_pages == 0 and bm.num_free_pages == 8 and bm.match_prefix(tokens)[0] == []


if __name__ == "__main__":   # the TP run, on the fake devices of this process
    for case in CASES:
        compare_with_the_loader(sys.argv[1], *case, {"model": 2}, jax_arrays=True)


def test_server_loads_a_checkpoint_between_requests(tmp_path, tmp_path_factory):
    """`--allow-weight-updates`: POST /update_weights_from_disk (sglang's) with checkpoint B while
    a request runs on A. The running request finishes with A's tokens, later ones get B's
    (transformers on each); checkpoints that do not fit are 400s naming `model_path`, after which
    the server still serves B."""
    # A: the API tests' model and engine (test_server.py), whose executables their servers store
    a_dir, a, _ = server_harness.bytes_model(tmp_path_factory)
    b = save_engine_model(str(tmp_path / "b"), seed=1, **server_harness.BYTES_MODEL)
    save_engine_model(str(tmp_path / "narrow"), hidden_size=32, **server_harness.BYTES_MODEL)
    prompt = np.random.default_rng(1).integers(0, 256, 9).tolist()
    server = server_harness.start(str(tmp_path), a_dir, "--allow-weight-updates", **server_harness.BYTES_ENGINE)
    try:
        client = server_harness.openai_client(server)

        def complete(max_tokens: int = NEW_TOKENS):
            return client.completions.create(model=os.path.basename(a_dir), prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                             extra_body=dict(ignore_eos=True, return_token_ids=True))

        def tokens(out) -> list[int]:
            return out.choices[0].model_extra["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(complete, 96)
            time.sleep(0.5)
            r = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "b")})
            assert r.status_code == 200 and r.json()["num_tensors"] == len(b.state_dict()), r.text
            assert tokens(running.result()) == hf_greedy(a, prompt, 96)[0]
        assert tokens(complete()) == hf_greedy(b, prompt, NEW_TOKENS)[0]
        with open(server.log_path) as f:
            log = f.read()
        assert log.index(f"{running.result().id}-0 prompt_tokens=") < log.index(f"loaded {len(b.state_dict())} tensors")

        for body, message in [({"model_path": str(tmp_path / "missing")}, "no *.safetensors files"),
                              ({"model_path": str(tmp_path / "narrow")}, "has shape (258, 32), expected (258, 64)"),
                              ({}, "'model_path' is required")]:
            r = requests.post(server.url + "/update_weights_from_disk", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
            assert message in r.json()["error"]["message"]
        assert tokens(complete()) == hf_greedy(b, prompt, NEW_TOKENS)[0]
    finally:
        assert server.stop() == 0, server.log_tail()


def test_weight_updates_are_off_unless_asked_for(tmp_path):
    from jaxserve.config import EngineConfig
    from jaxserve.server.app import create_app

    app = create_app(EngineConfig(model=str(tmp_path)))   # no model there: it never loads
    r = app.test_client().post("/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert r.status_code == 404 and "--allow-weight-updates" in r.get_json()["error"]["message"]
