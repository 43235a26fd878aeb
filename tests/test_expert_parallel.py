"""Mixtures of experts on several fake CPU devices, all in one subprocess on 8 of them (this file's
main: jax starts once, without torch). Expert parallelism (enable_expert_parallel:
parallel.EXPERT_PARALLEL_RULES, layers.SparseMoE): the experts split whole over the "model" axis.
On seeded checkpoints of Qwen3-MoE, OLMoE, DeepSeek-V3 (shared experts, grouped routing) and
gpt-oss (biased experts; and its experts as MXFP4, as the Hub stores them), and Qwen3-MoE's experts
in int8: the engine step's f32 logits equal one device's (each at model 2 or 4; under EP attention
stays tensor-parallel, so DeepSeek-V3's at model 4 is its latent attention with one query head a
device), the stacks (and their scales) lie on their expert axis while the router stays whole and
the shared experts tensor-parallel, experts that do not divide are refused; the engine's greedy
tokens equal transformers' for DeepSeek-V3 (sequence-parallel prefill too) and Qwen3-MoE.
Tensor parallelism (tests/test_moe.py's and tests/test_deepseek.py's, run here to share the
subprocess): the engine's greedy tokens equal transformers' for gpt-oss and DeepSeek-V2-Lite."""
import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxserve import cli
from jaxserve.config import EngineConfig
from tests.conftest import fake_devices_env
from tests.engine_runs import ENGINE, engine_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The step's logits against one device's, each variant at one model axis (suite time: each mesh
# is a program of its own): 4 experts at 2 (two a device) and at 4 (one), DeepSeek-V3's 8 at 4
# here and at 2 in its engine run below, Qwen3-MoE's at 2 here and at 4 in int8 and its engine run.
LOGITS_MESH = {"deepseek_v3": 4, "gpt_oss": 2, "olmoe": 4, "qwen3_moe": 2, "gpt_oss_mxfp4": 4, "qwen3_moe_int8": 4}
# The engine runs: (checkpoint, mesh, expert parallel). Under EP DeepSeek-V3's prefills run
# sequence-parallel too (each chunk's tokens split over "seq", the experts over "model"). Two EP
# families, not four (suite time): the engine adds nothing per family that the step's logits
# above do not check (the same step; each family's engine on one device: tests/test_moe.py).
# Under TP (intermediate dims split) gpt-oss's experts: 48 columns each, gate and up de-interleaved
# from gate_up_proj so each device holds matching halves, their biases with them, the down bias
# added once, the attention sinks split with their query heads, the router replicated; V2-Lite's:
# the query heads (q_proj without a bottleneck) and kv_b_proj split, the latent projections and
# the one KV head replicated, the routed and the 2 shared experts' intermediate dims split. The
# other families' experts load and run through the same code (V3 at TP 4, one query head a device:
# its attention in the logits above, which EP leaves tensor-parallel; its experts split as V2's).
ENGINE_RUNS = [("deepseek_v3", {"model": 2, "seq": 2}, True), ("qwen3_moe", {"model": 4}, True),
               ("gpt_oss", {"model": 2}, False), ("deepseek_v2_lite", {"model": 2}, False)]


def run_id(run) -> str:
    name, mesh, ep = run
    return "-".join([name, "ep" if ep else "tp", *(f"{axis}{n}" for axis, n in mesh.items())])


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """The subprocess's measurements, and transformers' greedy tokens of each engine's family."""
    # Here, not at the top: the subprocess imports this file, and torch costs it 9 s.
    from tests.hf_models import save_hf_model
    from tests.test_family_engine import save_with_greedy
    from tests.test_mxfp4 import save_mxfp4_gpt_oss

    dirs, expected = {}, {}
    for name in ("deepseek_v3", "gpt_oss", "olmoe", "qwen3_moe", "deepseek_v2_lite"):
        dirs[name] = str(tmp_path_factory.mktemp(name))
        if name in {run[0] for run in ENGINE_RUNS}:
            expected[name] = save_with_greedy(name, dirs[name])
        else:
            save_hf_model(name, dirs[name])
    dirs["gpt_oss_mxfp4"] = save_mxfp4_gpt_oss(tmp_path_factory.mktemp("gpt_oss_mxfp4"))[0]
    proc = subprocess.run([sys.executable, "-m", "tests.test_expert_parallel", json.dumps(dirs)], cwd=ROOT,
                          capture_output=True, text=True, env=fake_devices_env(8), timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "expected": expected}


@pytest.mark.parametrize("name", LOGITS_MESH)
def test_logits_equal_one_device(results, name):
    got = results["logits"][name]
    assert got["tokens_equal"] and got["max_logit_diff"] < 1e-5, got


@pytest.mark.parametrize("run", ENGINE_RUNS, ids=run_id)
def test_engine_greedy_equals_transformers(results, run):
    assert results["engine"][run_id(run)] == results["expected"][run[0]]


@pytest.mark.parametrize("name", LOGITS_MESH)
def test_stacks_split_on_their_expert_axis(results, name):
    """Every leaf of the stacks (weights, int8 and MXFP4 scales, gpt-oss's biases) on its expert
    axis and nothing else; the router replicated; DeepSeek's shared expert split by width (TP)."""
    specs = results["specs"][name]
    for leaf, spec in specs["experts"].items():
        assert spec[0] == "model" and not any(spec[1:]), (leaf, spec)
    assert {"gate_proj", "up_proj", "down_proj"} <= {leaf.split("/")[0] for leaf in specs["experts"]}
    assert not any(a for spec in specs["router"].values() for a in spec), specs["router"]
    if name == "deepseek_v3":
        assert specs["shared"] == ["model", None]
    if name == "gpt_oss_mxfp4":
        assert {"gate_proj/scale", "down_proj/qweight", "gate_proj_bias"} <= set(specs["experts"])


def test_experts_that_do_not_divide_are_refused(results):
    assert "the 4 experts do not divide over the model axis of 8 devices" in results["refused"]


def test_one_all_reduce_of_the_tokens_and_nothing_else(results):
    """An MoE layer under EP on 4 devices: no all-to-all, no gather of the experts, only the
    all-reduce of [tokens, hidden] that TP pays too."""
    assert results["collectives"] == [["f32[16,64]", "all-reduce"]]


def test_flag_reaches_the_engine_config():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--enable-expert-parallel"])
    assert cli.engine_config(args).enable_expert_parallel
    with pytest.raises(ValueError, match="enable_expert_parallel must be true or false"):
        EngineConfig(enable_expert_parallel="yes")


def _specs(params, layer: int) -> dict:
    """The MoE layer's shardings: its stacks' leaves, its router's, its shared expert's gate_proj."""
    moe = params["model"][f"layers_{layer}"]["mlp"]
    flat = jax.tree_util.tree_flatten_with_path(moe["experts"])[0]
    spec = lambda x: list(x.sharding.spec) + [None] * (x.ndim - len(x.sharding.spec))   # noqa: E731
    return {"experts": {"/".join(k.key for k in path): spec(x) for path, x in flat},
            "router": {k: spec(x) for k, x in moe["gate"].items()},
            "shared": spec(moe["shared_experts"]["gate_proj"]["weight"]) if "shared_experts" in moe else None}


def main(dirs: dict[str, str]) -> dict:
    from jaxserve import LLM, parallel, quantization
    from jaxserve.checkpoint import load_params
    from jaxserve.config import ModelConfig
    from jaxserve.generate import greedy_generate
    from jaxserve.models import layers
    from tests import parallel_checks

    out = {"logits": {}, "specs": {}, "engine": {}}
    for name, model in LOGITS_MESH.items():
        d, mode = (dirs["qwen3_moe"], "int8") if name == "qwen3_moe_int8" else (dirs[name], None)
        cfg = ModelConfig.from_pretrained(d)
        params = quantization.quantize_params(load_params(d, cfg), mode)
        ref_tokens, ref_logits = greedy_generate(cfg, params, parallel_checks.prompts(), parallel_checks.NEW_TOKENS,
                                                 return_logits=True)
        ep = dataclasses.replace(cfg, expert_parallel=True)
        mesh = parallel.make_mesh({"model": model}, jax.devices()[:model])
        sharded = jax.device_put(params, parallel.param_shardings(params, mesh, ep))
        tokens, logits = parallel_checks.sharded_generate(ep, sharded, mesh, False)
        out["logits"][name] = {"tokens_equal": tokens.tolist() == ref_tokens,
                               "max_logit_diff": float(np.abs(logits - ref_logits).max())}
        out["specs"][name] = _specs(sharded, cfg.moe_layers[0])
    for run in ENGINE_RUNS:
        name, mesh, ep = run
        out["engine"][run_id(run)] = engine_tokens(dirs[name], mesh=mesh, enable_expert_parallel=ep)[0]
    mesh = parallel.make_mesh({"model": 4}, jax.devices()[:4])
    moe = layers.SparseMoE(8, 2, 32, True, mesh=mesh, expert_parallel=True)
    x = jax.ShapeDtypeStruct((16, 64), np.float32, sharding=parallel.replicated(mesh))
    shapes = jax.eval_shape(moe.init, jax.random.key(0), x)
    ep = dataclasses.replace(ModelConfig.from_pretrained(dirs["qwen3_moe"]), expert_parallel=True)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                          {"params": parallel.param_shardings(shapes["params"], mesh, ep)})
    hlo = jax.jit(moe.apply).lower(params, x).compile().as_text()
    out["collectives"] = re.findall(r"= (\w+\[[\d,]*\])\S* (all-reduce|all-gather|all-to-all|collective-permute)\(", hlo)
    try:
        LLM(model=dirs["qwen3_moe"], mesh={"model": 8}, enable_expert_parallel=True, **ENGINE)
        out["refused"] = "not refused"
    except ValueError as e:
        out["refused"] = str(e)
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
