"""Multi-LoRA serving (jaxserve/lora.py) against transformers + peft on a seeded tiny Llama and
seeded PEFT adapters written by peft's save_pretrained: greedy tokens and logprobs of base and
adapter rows mixed in one batch, adapters loaded on demand into the least recently used slot,
requests of more adapters than slots waiting for one, an adapter removed while its requests run,
no prefix-cache page shared across adapters, and adapters the engine cannot serve refused with
clear errors. The OpenAI server's adapters: tests/test_lora_server.py."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import peft
import pytest
import torch
import transformers as tf

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.compilations import CompileCounter
from jaxserve.sampling_params import InvalidRequest
from tests.conftest import fake_devices_env
from tests.hf_models import save_byte_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_TOKENS = 12
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16, max_prefill_seqs=1,
              page_size=8, max_model_len=128, num_pages=64, compilation_cache_dir=None,
              step_shapes="largest")
# The engines that run their rows (up to 9: [base, a1, a2] x prompts) once, not warmed up: all
# prefill in one step and decode together to the end, so they compile few step shapes (the int8
# engine 2, not 5; chunked prefill of adapter rows: the tests on ENGINE).
ONE_WAVE = dict(ENGINE, max_num_seqs=16, max_num_batched_tokens=256, prefill_chunk_size=32, max_prefill_seqs=9)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, LoraConfig fields): a1 every projection; a2 a few at a smaller rank, rsLoRA's
# scaling; a3 (loaded on demand) at the full max_lora_rank.
ADAPTERS = {"a1": (1, dict(r=8, lora_alpha=16, target_modules=ALL)),
            "a2": (2, dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])),
            "a3": (3, dict(r=16, lora_alpha=8, target_modules=["k_proj", "o_proj", "up_proj"]))}


def save_adapter(base_dir: str, out_dir: str, seed: int, **config):
    """A PEFT adapter of the base model with seeded random A and B (PEFT starts B at zero), saved;
    returns the PEFT model."""
    model = tf.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(out_dir)
    return model.eval()


def reference(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and the logprobs [NEW_TOKENS, vocab] before each, by transformers (+ peft)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return ids[0, len(prompt):].tolist(), torch.log_softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("base"))
    hf = save_hf_model("llama_gqa_rope3", base).eval()
    save_byte_tokenizer(base)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 19, 30)]
    dirs, expected = {}, {None: [reference(hf, p) for p in prompts]}
    for name, (seed, config) in ADAPTERS.items():
        dirs[name] = str(tmp_path_factory.mktemp(name))
        model = save_adapter(base, dirs[name], seed, **config)
        expected[name] = [reference(model, p) for p in prompts]
    return base, dirs, prompts, expected


@pytest.fixture(scope="module")
def llm(setup):
    base, dirs, _, _ = setup
    llm = LLM(model=base, lora_modules={n: dirs[n] for n in ("a1", "a2")}, max_loras=2, **ENGINE)
    llm.llm_engine.warmup()
    return llm


def request(dirs: dict, name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, int(name[1]), dirs[name])


def check(outputs, names, prompt_index, expected):
    """Each output equals its adapter's reference: tokens, and the top-5 logprobs of each step."""
    for out, name, i in zip(outputs, names, prompt_index):
        tokens, logprobs = expected[name][i]
        assert out.outputs[0].token_ids == tokens, (name, i)
        for step, lp in enumerate(out.outputs[0].logprobs):
            top = np.argsort(-logprobs[step])[:5]
            assert list(lp) == top.tolist(), (name, i, step)   # (greedy: the sampled token is the first)
            assert np.allclose([lp[t].logprob for t in top], logprobs[step, top], atol=1e-4), (name, i, step)


SAMPLING = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def test_mixed_batch_matches_peft_in_one_step_without_compiling(setup, llm):
    """Base, a1 and a2 rows of every prompt in one generate call: each equals transformers + peft
    alone; decode steps ran rows of all three at once; nothing compiled after warm-up."""
    _, dirs, prompts, expected = setup
    names = [None, "a1", "a2"] * len(prompts)
    before = CompileCounter.count
    mixed = generate_each_adapter(llm, setup, names, lambda s: s.seq.lora_slot)
    assert {0, 1, 2} in mixed
    assert CompileCounter.count == before


def generate_each_adapter(llm, setup, names, what):
    """Every prompt once per adapter in `names` (None: the base model) in one generate call, each
    output checked against peft's; returns, for each engine step, {what(row)} of its rows."""
    _, dirs, prompts, expected = setup
    index = [i for i in range(len(prompts)) for _ in range(len(names) // len(prompts))]
    engine, seen = llm.llm_engine, []
    step = engine.step

    def watched():
        outputs = step()
        seen.append({what(s) for s in engine.last_schedule.scheduled} - {None})
        return outputs

    engine.step = watched
    try:
        outs = llm.generate([prompts[i] for i in index], SAMPLING, use_tqdm=False,
                            lora_request=[request(dirs, n) for n in names])
    finally:
        del engine.step
    check(outs, names, index, expected)
    return seen


def test_speculative_decoding_with_adapters(setup):
    """A draft model (the base model itself, without adapters) proposes; the target verifies LoRA
    rows through the same per-token slots: outputs unchanged, base rows' proposals all accepted,
    adapter rows' partly."""
    base, dirs, prompts, expected = setup
    spec = dict(method="draft", model=base, num_tokens=3, disable_by_batch_size=8)
    llm = LLM(model=base, lora_modules={"a1": dirs["a1"]}, speculative=spec, **ONE_WAVE)
    names = [None, "a1"] * len(prompts)
    index = [i for i in range(len(prompts)) for _ in range(2)]
    outs = llm.generate([prompts[i] for i in index], SAMPLING, use_tqdm=False,
                        lora_request=[request(dirs, n) for n in names])
    check(outs, names, index, expected)
    stats = llm.llm_engine.stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]


def test_tensor_parallel_and_multi_step(setup):
    """TP 2 (fake CPU devices, in a subprocess), 4 decode steps a program: B split with the
    column-parallel outputs, A with the row-parallel inputs; outputs unchanged. And with
    sequence-parallel prefill over 2 (each prompt's tokens split, on their adapter's slot)."""
    base, dirs, prompts, expected = setup
    proc = subprocess.run([sys.executable, "-m", "tests.test_lora", json.dumps([base, dirs, prompts])], cwd=ROOT,
                          capture_output=True, text=True, env=fake_devices_env(2), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    names = [None, "a1", "a2"] * len(prompts)
    for run in ("tokens", "sequence_parallel_tokens"):
        for tokens, name, i in zip(result[run], names, [i for i in range(len(prompts)) for _ in range(3)]):
            assert tokens == expected[name][i][0], (run, name, i)
    assert result["specs"] == {"q_proj/a": [None, None, None], "q_proj/b": ["model", None, None],
                               "o_proj/a": [None, None, "model"], "o_proj/b": [None, None, None]}
    assert result["multi_step_decodes"] > 0


def test_adapter_loaded_on_demand_into_the_idle_slot(setup, llm):
    """a3 is not among lora_modules: it loads into the least recently used slot (a1's, after the
    test above used a2 last), and a1 loads again when asked for; both still equal peft."""
    _, dirs, prompts, expected = setup
    adapters = llm.llm_engine.loras
    before = CompileCounter.count
    for name in ("a3", "a1"):
        outs = llm.generate(prompts, SAMPLING, use_tqdm=False, lora_request=request(dirs, name))
        check(outs, [name] * len(prompts), range(len(prompts)), expected)
    assert {a.name: slot for a, slot in adapters.slot_of.items()} == {"a1": 2, "a3": 1}
    assert CompileCounter.count == before


def test_an_engine_without_start_up_adapters_compiles_its_slot_store_at_start(setup):
    """enable_lora without lora_modules: the program that stores an adapter into a slot compiles
    as the Adapters are built (zeros into slot 1), so the first request's load compiles nothing."""
    from types import SimpleNamespace

    from jaxserve import lora, parallel
    from jaxserve.config import EngineConfig, ModelConfig

    base, dirs, _, _ = setup
    CompileCounter.install()
    adapters = lora.Adapters(ModelConfig.from_pretrained(base), EngineConfig(model=base, enable_lora=True, max_loras=1),
                             parallel.make_mesh(devices=jax.devices()[:1]), np.float32)
    before = CompileCounter.count
    adapters.register(request(dirs, "a3"))
    adapters.assign([SimpleNamespace(lora=adapters.known["a3"], lora_slot=None)])
    assert CompileCounter.count == before
    path, (a, _) = next(iter(adapters.known["a3"].weights.items()))
    np.testing.assert_array_equal(np.asarray(lora_weights(adapters, path)["a"][0, :a.shape[0]]), a)


def lora_weights(adapters, path):
    node = adapters.weights
    for key in path:
        node = node[key]
    return node


def test_adapters_over_int8_weights(setup):
    """Adapters on a quantized base (as on a pre-quantized checkpoint; int8: this model's inputs of
    64 are too few for int4's groups of 128): each output equals peft's
    over the base model whose Linear weights are the quantized ones, dequantized (by
    jaxserve.quantization, whose rounding tests/test_quantization.py checks against numpy)."""
    from jaxserve import quantization

    base, dirs, prompts, _ = setup
    hf = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                q = quantization.quantize_weight(module.weight.numpy(), "int8")
                module.weight.copy_(torch.tensor(np.asarray(quantization.dequantize(q["qweight"], q["scale"]))))
    expected = {None: [reference(hf, p) for p in prompts]}
    expected["a1"] = [reference(peft.PeftModel.from_pretrained(hf, dirs["a1"]).eval(), p) for p in prompts]
    llm = LLM(model=base, quantization="int8", lora_modules={"a1": dirs["a1"]}, **ONE_WAVE)
    names = [None, "a1"] * len(prompts)
    index = [i for i in range(len(prompts)) for _ in range(2)]
    check(llm.generate([prompts[i] for i in index], SAMPLING, use_tqdm=False,
                       lora_request=[request(dirs, n) for n in names]), names, index, expected)


def test_more_adapters_than_slots_wait_for_one(setup, llm):
    """Base, a1, a2 and a3 rows of every prompt in one generate call, 2 slots: no step runs more
    than 2 adapters, every adapter runs, and every output equals peft's."""
    prompts = setup[2]
    running = generate_each_adapter(llm, setup, [None, "a1", "a2", "a3"] * len(prompts),
                                    lambda s: s.seq.lora and s.seq.lora.name)
    assert max(map(len, running)) == 2 and set().union(*running) == {"a1", "a2", "a3"}


def test_removed_adapter_runs_on_for_its_requests(setup, llm):
    """a1 (running) and a3 (waiting for a slot a1 and a2 hold) are removed: their requests finish
    as peft's, new ones are refused. The name a1 then registered with a3's weights finds none of
    the old a1's cached pages (the prefix cache keys on the adapter, not its name)."""
    _, dirs, prompts, expected = setup
    engine = llm.llm_engine
    ids = {}
    for name in ("a1", "a2", "a3"):
        engine.loras.register(request(dirs, name))
        ids[engine.add_request(prompts[1], dataclasses.replace(SAMPLING, lora_name=name))] = name
    tokens = {request_id: [] for request_id in ids}

    def step():
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids

    while {s.lora.name for s in engine.scheduler.running} != {"a1", "a2"}:
        step()
    assert [s.lora.name for s in engine.scheduler.waiting] == ["a3"]
    engine.loras.remove("a1")
    engine.loras.remove("a3")
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'a1'"):
        engine.new_request(prompts[1], dataclasses.replace(SAMPLING, lora_name="a1"))
    while engine.has_unfinished():
        step()
    assert {ids[r]: t for r, t in tokens.items()} == {n: expected[n][1][0] for n in ("a1", "a2", "a3")}

    hits = engine.block_manager.prefix_hit_tokens
    [out] = llm.generate(prompts[1], SAMPLING, use_tqdm=False, lora_request=LoRARequest("a1", 1, dirs["a3"]))
    assert out.outputs[0].token_ids == expected["a3"][1][0]
    assert engine.block_manager.prefix_hit_tokens == hits
    engine.loras.remove("a1")   # the later tests' a1 is a1's


def test_prefix_cache_never_shared_across_adapters(setup, llm):
    """The same 40-token prompt (5 pages) under base, a1, a2, then a1 again: the outputs differ,
    and only the second a1 run finds cached pages (the prompt's 4 full pages before its last token)."""
    _, dirs, _, _ = setup
    prompt = np.random.default_rng(7).integers(0, 256, 40).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    bm, tokens, hits = llm.llm_engine.block_manager, [], []
    for name in (None, "a1", "a2", "a1"):
        before = bm.prefix_hit_tokens
        [out] = llm.generate(prompt, sp, use_tqdm=False, lora_request=request(dirs, name))
        tokens.append(out.outputs[0].token_ids)
        hits.append(bm.prefix_hit_tokens - before)
    assert len({tuple(t) for t in tokens[:3]}) == 3 and tokens[3] == tokens[1]
    assert hits == [0, 0, 0, 32]


@pytest.mark.parametrize("family, modules", [("phi3_fused", ["qkv_proj", "gate_up_proj", "o_proj"]),
                                             ("gpt2_conv1d", ["c_attn", "c_fc", "c_proj"])])
def test_fused_projections_map_by_rows(tmp_path, family, modules):
    """Phi-3's fused qkv_proj and gate_up_proj, loaded as jaxserve's q/k/v and gate/up: an adapter
    on the fused modules applies through the rows of its B (A shared), as peft computes it. GPT-2's
    c_attn likewise, its Conv1D modules adapted as peft does (fan_in_fan_out)."""
    base, adapter = str(tmp_path / family), str(tmp_path / "fused")
    save_hf_model(family, base)
    save_byte_tokenizer(base)
    model = save_adapter(base, adapter, 4, r=8, lora_alpha=8, target_modules=modules)
    prompts = [np.random.default_rng(1).integers(0, 256, n).tolist() for n in (7, 20)]
    expected = {"fused": [reference(model, p) for p in prompts]}
    llm = LLM(model=base, lora_modules={"fused": adapter}, **ENGINE)
    outs = llm.generate(prompts, SAMPLING, use_tqdm=False, lora_request=LoRARequest("fused", 1, adapter))
    check(outs, ["fused"] * 2, range(2), expected)


@pytest.mark.parametrize("change, error", [
    (dict(r=32, lora_alpha=32), "rank 32 is above max_lora_rank 16"),
    (dict(use_dora=True), r"DoRA \(use_dora\) is not supported"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "cannot apply.*embed_tokens"),
    (dict(bias="lora_only"), "bias 'lora_only' is not supported"),
])
def test_adapters_jaxserve_cannot_serve_are_refused(setup, llm, tmp_path, change, error):
    base, _, prompts, _ = setup
    save_adapter(base, str(tmp_path), 5, **{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], **change})
    with pytest.raises(ValueError, match=error):
        llm.generate(prompts[0], SAMPLING, use_tqdm=False, lora_request=LoRARequest("bad", 9, str(tmp_path)))


def test_missing_files_and_unknown_names_are_refused(setup, llm, tmp_path):
    _, _, prompts, _ = setup
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(prompts[0], SAMPLING, use_tqdm=False, lora_request=LoRARequest("gone", 8, str(tmp_path)))
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'nope'"):
        llm.generate(prompts[0], SamplingParams(lora_name="nope"), use_tqdm=False)


if __name__ == "__main__":   # test_tensor_parallel_and_multi_step's engine, on this process's fake devices
    base, dirs, prompts = json.loads(sys.argv[1])
    def tokens(llm):
        outs = llm.generate([p for p in prompts for _ in range(3)], SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False,
            lora_request=[request(dirs, n) for n in [None, "a1", "a2"] * len(prompts)])
        return [o.outputs[0].token_ids for o in outs]
    llm = LLM(model=base, lora_modules=dirs, mesh={"model": 2}, decode_steps=4, **ONE_WAVE)
    layer = llm.llm_engine.loras.weights["model"]["layers_0"]["self_attn"]
    specs = {f"{m}/{leaf}": [*layer[m][leaf].sharding.spec] + [None] * (3 - len(layer[m][leaf].sharding.spec))
             for m in ("q_proj", "o_proj") for leaf in "ab"}
    print(json.dumps({"tokens": tokens(llm), "specs": specs,
                      "multi_step_decodes": llm.llm_engine.stats["multi_step_decodes"],
                      "sequence_parallel_tokens": tokens(LLM(model=base, lora_modules=dirs, mesh={"seq": 2}, **ONE_WAVE))}))


def test_settings_are_checked_and_reach_the_engine_config():
    from jaxserve import cli
    from jaxserve.config import EngineConfig

    flags = ["serve", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-lora-rank", "8"]
    cfg = cli.engine_config(cli.build_parser().parse_args(flags))
    assert (cfg.lora_modules, cfg.serves_lora, cfg.lora_slots, cfg.max_lora_rank) == (
        {"sql": "/a/sql", "chat": "/a/chat"}, True, 2, 8)
    cfg = cli.engine_config(cli.build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "3"]))
    assert (cfg.lora_modules, cfg.serves_lora, cfg.lora_slots) == ({}, True, 3)
    with pytest.raises(SystemExit, match="NAME=PATH"):
        cli.engine_config(cli.build_parser().parse_args(["serve", "--lora-modules", "sql"]))
    with pytest.raises(ValueError, match="max_loras and max_lora_rank must be at least 1"):
        EngineConfig(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match="multi-host engine loads LoRA adapters at start only"):
        EngineConfig(lora_modules={"a": "/a", "b": "/b"}, max_loras=1,
                     distributed=dict(coordinator_address="h:1", num_processes=2, process_id=0))
