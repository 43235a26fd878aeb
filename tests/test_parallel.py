"""Mesh and sharding rules (in process, on abstract meshes), and tensor / sequence / data parallel
runs on 8 fake CPU devices (in a subprocess running tests/parallel_checks.py: the device count is
fixed when jax starts)."""
import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, PartitionSpec as P

from jaxserve import parallel
from jaxserve.checkpoint import param_shapes
from jaxserve.config import ModelConfig
from tests.conftest import fake_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_cfg(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                intermediate_size=128, num_layers=1, num_heads=8, num_kv_heads=8, head_dim=8)
    return ModelConfig(**{**base, **kw})


def tp_mesh(model: int) -> AbstractMesh:
    return AbstractMesh(tuple(model if a == "model" else 1 for a in parallel.MESH_AXES), parallel.MESH_AXES)


def specs(cfg, model: int) -> dict[str, P]:
    mesh = tp_mesh(model)
    shardings = parallel.param_shardings(param_shapes(cfg), mesh, cfg)
    return {"/".join(k.key for k in path): s.spec
            for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


def test_make_mesh_default_and_errors():
    mesh = parallel.make_mesh()
    assert mesh.axis_names == parallel.MESH_AXES
    assert dict(mesh.shape) == {"data": 1, "model": 1, "seq": 1}
    with pytest.raises(ValueError, match="needs 4 devices"):
        parallel.make_mesh({"model": 4}, jax.devices()[:1])
    with pytest.raises(ValueError, match="needs 1024 devices"):
        parallel.make_mesh({"model": 1024})
    with pytest.raises(ValueError, match="unknown mesh axes"):
        parallel.make_mesh({"tensor": 1})


def test_megatron_layout():
    s = specs(small_cfg(qkv_bias=True), model=4)
    layer = "model/layers_0/"
    for name in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj", "mlp/gate_proj",
                 "mlp/up_proj"):
        assert s[layer + name + "/weight"] == P("model", None), name   # split over outputs
    for name in ("self_attn/o_proj", "mlp/down_proj"):
        assert s[layer + name + "/weight"] == P(None, "model"), name   # split over inputs
    for name in ("self_attn/q_proj", "self_attn/k_proj", "self_attn/v_proj"):
        assert s[layer + name + "/bias"] == P("model"), name           # biases follow outputs
    assert s["model/embed_tokens/embedding"] == P("model", None)        # vocab
    assert s["lm_head/weight"] == P("model", None)                       # vocab
    for name in (layer + "input_layernorm/weight", layer + "post_attention_layernorm/weight",
                 "model/norm/weight"):
        assert s[name] == P(None), name


def test_single_device_is_all_replicated():
    assert all(spec == P(*[None] * len(spec)) for spec in specs(small_cfg(), model=1).values())


def test_kv_heads_that_do_not_divide_are_replicated():
    cfg = small_cfg(num_kv_heads=2)
    s = specs(cfg, model=4)
    layer = "model/layers_0/self_attn/"
    assert s[layer + "k_proj/weight"] == P(None, None)   # 2 kv heads: no whole head per device
    assert s[layer + "v_proj/weight"] == P(None, None)
    assert s[layer + "q_proj/weight"] == P("model", None)
    assert s[layer + "o_proj/weight"] == P(None, "model")
    mesh = tp_mesh(4)
    assert parallel.kv_cache_sharding(cfg, mesh).spec == P(None, None, None, None)
    assert parallel.kv_cache_sharding(small_cfg(num_kv_heads=4), mesh).spec == \
        P(None, "model", None, None)


def test_heads_split_only_whole():
    # 6 heads of 8 = 48 columns divide by 4, but 6 heads do not: q and o stay whole.
    s = specs(small_cfg(num_heads=6, num_kv_heads=6, vocab_size=250), model=4)
    assert s["model/layers_0/self_attn/q_proj/weight"] == P(None, None)
    assert s["model/layers_0/self_attn/o_proj/weight"] == P(None, None)
    assert s["model/layers_0/mlp/up_proj/weight"] == P("model", None)
    assert s["lm_head/weight"] == P(None, None)                 # 250 does not divide by 4
    assert parallel.logits_sharding(small_cfg(vocab_size=250),
                                    tp_mesh(4)).spec == P(None, None)


def test_qk_norms_split_with_the_heads_only_over_the_whole_projection():
    layer = "model/layers_0/self_attn/"
    olmo2 = specs(small_cfg(architecture="Olmo2ForCausalLM", num_kv_heads=2, qk_norm=True, qk_norm_per_head=False,
                            sandwich_norms=True, pre_norms=False), model=4)
    assert olmo2[layer + "q_norm/weight"] == P("model")   # [heads * head_dim], as q_proj's rows
    assert olmo2[layer + "k_norm/weight"] == P(None)      # 2 kv heads at TP 4: whole, as k_proj
    qwen3 = specs(small_cfg(architecture="Qwen3ForCausalLM", qk_norm=True), model=4)
    assert qwen3[layer + "q_norm/weight"] == qwen3[layer + "k_norm/weight"] == P(None)   # [head_dim]: every head's


def test_every_param_has_logical_axes_of_its_rank():
    cfg = small_cfg(qkv_bias=True, tie_word_embeddings=True)
    shapes = param_shapes(cfg)
    axes = parallel.param_logical_axes(shapes, cfg)
    for a, s in zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
                    jax.tree.leaves(shapes)):
        assert len(a) == len(s.shape) and all(n in parallel.LOGICAL_RULES for n in a)


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict:
    """The checks of tests/parallel_checks.py, run once in one subprocess (8 fake devices) on one saved engine model: {check: its values,
    or {"error": traceback}}."""
    from tests.hf_models import save_engine_model

    model_dir = str(tmp_path_factory.mktemp("parallel_model"))
    save_engine_model(model_dir)
    env = fake_devices_env(8)
    proc = subprocess.run([sys.executable, "-m", "tests.parallel_checks", model_dir], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def result(checks: dict, name: str) -> dict:
    r = checks[name]
    assert "error" not in r, r["error"]
    return r


@pytest.mark.parametrize("check", ["tp", "sp", "pallas_tp"])
def test_same_greedy_tokens_and_logits_as_one_device(checks, check):
    # tp: TP 8 on 8 heads / 8 kv heads, TP 4 on 2 kv heads; sp: sequence-parallel prefill
    # (one prompt with a cached prefix) on SP 4 and TP x SP 2x2, then decoding; pallas_tp: TP 2
    # through the Pallas kernels' shard_map (the TPU kernels, interpret mode) with ALiBi (each
    # device's KV heads and their slopes) and with one KV head (replicated, each device's query
    # heads over the whole pool: DeepSeek's latent attention).
    results = result(checks, check)
    assert len(results) == {"tp": 2, "sp": 2, "pallas_tp": 2}[check]
    for case, r in results.items():
        assert r["tokens_equal"], case
        assert r["max_logit_diff"] < 1e-4, (case, r)


def test_collectives_per_step_are_the_layout_minimum(checks):
    layers = 2
    r = result(checks, "hlo")
    # The runner's decode step under TP 4: one all-reduce per attention block and one per MLP
    # (Megatron), one for the vocab-split embedding lookup, one all-gather of the vocab-split
    # logits. Nothing touches the KV cache (with 2 kv heads it is replicated, not resharded).
    # The Pallas kernels run per device on their own KV heads (shard_map): the same collectives.
    for name in ("even decode tp4", "gqa2 decode tp4", "even decode tp4 pallas_gpu",
                 "even decode tp4 pallas_tpu"):
        assert r[name] == {"all-reduce": {"4": 2 * layers + 1}, "all-gather": {"4": 1}}, r[name]
    # Sequence-parallel prefill under TP 2 x SP 2: the same TP all-reduces (over 2), plus per
    # layer one all-gather of K and one of V over "seq" (heads stay split: no gather over
    # "model"), the psum of the last token's hidden state, and the logits gather.
    assert r["even sp-prefill tp2 sp2"] == {"all-reduce": {"2": 2 * layers + 2},
                                            "all-gather": {"2": 2 * layers + 1}}, r


def test_tp4_params_per_device_are_a_quarter(checks):
    r = result(checks, "param_bytes")
    assert r["values_equal"]
    assert 0.25 <= r["per_device"] / r["total"] < 0.26, r   # only the norms are replicated


def test_data_parallel_replicas_match_one_device(checks):
    r = result(checks, "dp")
    assert r["tokens_equal"]
    assert r["finished_per_replica"] == [3, 3]                 # least-loaded: alternating
    assert r["replica_devices"] == [[0, 1], [2, 3]]            # disjoint TP-2 sub-meshes
    assert r["param_devices"] == r["replica_devices"]


def test_engine_routes_prefills_through_sequence_parallel(checks):
    # The engine on a {"model": 2, "seq": 2} mesh.
    r = result(checks, "engine_sp")
    assert r["tokens_equal"]
    # Prompts of 5, 40, 70, 23 tokens in chunks of at most 32 (less beside decodes): every
    # prefill chunk ran sequence-parallel, later chunks on top of cached ones.
    assert sum(r["prefill_tokens"]) == 5 + 40 + 70 + 23 and len(r["prefill_tokens"]) > 4, r
    assert r["compiles_after_warmup"] == 0
    # The 70-token prompt's logprobs, every chunk's scored from its sequence-parallel hidden states.
    assert r["prompt_logprobs_tokens_equal"], r
    assert r["prompt_logprobs_max_diff"] < 1e-4, r
    assert r["prompt_logprobs_tops"] == [2, 2, 2], r
