"""Quantized mixture-of-experts weights (`--quantization int8 | int4 | int4_asym | fp8` on the stacked experts,
jaxserve/models/experts.py): both expert paths against a numpy dequantize-then-matmul oracle, a
seeded Qwen3-MoE through the engine quantized against transformers unquantized, tensor parallelism
2 against the model's forward pass on one device, and the weight bytes (what is refused:
tests/test_moe.py)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from jaxserve import LLM, SamplingParams, quantization
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.models import build_model, experts, layers
from tests.conftest import fake_devices_env
from tests.hf_models import hf_greedy, save_byte_tokenizer, save_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("int8", "int4", "int4_asym", "fp8", "mxfp4")
# every Linear's inputs whole groups of 128 (4 heads of 32), an expert width of 256: two groups per device at TP 2
SHAPES = dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256, head_dim=32)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64, max_model_len=128,
              kv_cache_mb=4, compilation_cache_dir=None, step_shapes="largest")
PROMPT_TOKENS, NEW_TOKENS = 12, 16


def numpy_dequantize(leaves: dict) -> np.ndarray:
    """The stack [experts, out, in] that quantization's leaves stand for, by its layout's rules
    (MXFP4's: transformers' dequantization, convert_moe_packed_tensors)."""
    q, scale = np.asarray(leaves["qweight"]), np.asarray(leaves["scale"])
    if scale.dtype == np.uint8:
        blocks = torch.from_numpy(np.array(q).reshape(*scale.shape, 16))
        return convert_moe_packed_tensors(blocks, torch.from_numpy(np.array(scale)), dtype=torch.float32).numpy().swapaxes(-1, -2)
    scale = scale.astype(np.float32)
    if scale.ndim == 2:   # int8: one scale per output channel
        return q.astype(np.float32) * scale[..., None]
    if q.dtype == np.uint8:   # int4: byte k of a group holds input k (low nibble) and k + 64 (high)
        nibbles = [(q & 0xF).astype(np.int8), (q >> 4).astype(np.int8)]
        low, high = (np.where(n > 7, n - 16, n).reshape(*q.shape[:-1], -1, 64) for n in nibbles)
        values = np.concatenate([low, high], axis=-1).astype(np.float32)
    else:   # fp8
        values = q.astype(np.float32).reshape(*q.shape[:-1], -1, 128)
    zero = np.asarray(leaves.get("zero", np.zeros_like(scale)), np.float32)   # int4_asym's offsets
    return (values * scale[..., None] - zero[..., None]).reshape(*q.shape[:-1], -1)


@pytest.mark.parametrize("mode", MODES)
def test_expert_products_match_dequantize_then_matmul(mode, monkeypatch):
    """Both paths (every_expert, grouped_experts) over a quantized stack, two experts a chunk,
    equal the experts' sum computed in numpy from the dequantized weights (mxfp4: gpt-oss's
    checkpoints' format, here from quantization's own MXFP4 quantizer)."""
    monkeypatch.setattr(experts, "CHUNK_ELEMENTS", 2 * 256 * 128)
    rng = np.random.RandomState(0)
    num, width, hidden, tokens, k = 4, 256, 128, 6, 2
    shapes = {"gate_proj": (num, width, hidden), "up_proj": (num, width, hidden), "down_proj": (num, hidden, width)}
    stacks = {n: quantization.quantize_weight(rng.randn(*s).astype(np.float32) * 0.1, mode) for n, s in shapes.items()}
    x = rng.randn(tokens, hidden).astype(np.float32)
    chosen = np.stack([rng.choice(num, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.rand(tokens, k).astype(np.float32)
    w = {n: numpy_dequantize(s) for n, s in stacks.items()}
    expected = np.zeros_like(x)
    for t in range(tokens):
        for e, p in zip(chosen[t], weights[t]):
            gate, up = w["gate_proj"][e] @ x[t], w["up_proj"][e] @ x[t]
            expected[t] += p * (w["down_proj"][e] @ (gate / (1 + np.exp(-gate)) * up))
    glu = layers.gated(jax.nn.silu)
    for path in (experts.every_expert, experts.grouped_experts):
        got = experts.in_chunks(path, jnp.asarray(x), jnp.asarray(weights), jnp.asarray(chosen), stacks, glu)
        np.testing.assert_allclose(np.asarray(got), expected, atol=2e-5, err_msg=path.__name__)


def prompts(vocab: int) -> list[list[int]]:
    return [np.random.RandomState(i).randint(1, vocab, PROMPT_TOKENS).tolist() for i in range(3)]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """(a seeded Qwen3-MoE's dir, transformers' greedy tokens of `prompts`, unquantized)."""
    d = str(tmp_path_factory.mktemp("qwen3_moe_q"))
    hf = save_hf_model("qwen3_moe", d, **SHAPES)
    save_byte_tokenizer(d)
    return d, [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts(hf.config.vocab_size)]


def greedy(llm: LLM, vocab: int) -> list[list[int]]:
    out = llm.generate(prompts(vocab),
                       SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_quantized_moe_logits_and_bytes(qwen3_moe):
    """The seeded Qwen3-MoE's logits quantized against unquantized, their mean error relative to
    their spread (measured: int8 0.019, fp8 0.086, int4 0.36, int4_asym 0.30: random weights, every Linear
    quantized), and the bytes of its expert stacks: int8 1/4 of f32 plus a scale a row (f32), fp8 1/4
    plus a scale per 128 inputs, int4 1/8 plus a scale per 128, int4_asym a zero-point offset more; the
    router stays in f32."""
    d = qwen3_moe[0]
    cfg = ModelConfig.from_pretrained(d)
    model = build_model(cfg)
    tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 24))
    positions = np.broadcast_to(np.arange(24), tokens.shape)
    full = load_params(d, cfg)
    ref = np.asarray(model.apply({"params": full}, tokens, positions, method=model.forward_logits))
    moe = ("model", "layers_1", "mlp")
    full_stacks = quantization.node(full, moe + ("experts",)).values()
    for mode, tol, bits, scale_every, scales in (("int8", 0.03, 8, None, 1), ("fp8", 0.12, 8, 128, 1),
                                                 ("int4", 0.45, 4, 128, 1), ("int4_asym", 0.4, 4, 128, 2)):
        params = load_params(d, cfg, quantization=mode)
        got = np.asarray(model.apply({"params": params}, tokens, positions, method=model.forward_logits))
        assert np.abs(got - ref).mean() < tol * ref.std(), (mode, np.abs(got - ref).mean(), ref.std())
        stacks = quantization.node(params, moe + ("experts",))
        assert quantization.weight_bytes(stacks) == sum(
            w.size * bits // 8 + scales * 4 * w.size // (scale_every or w.shape[-1]) for w in full_stacks), mode
        assert quantization.node(params, moe + ("gate",))["weight"].dtype == jnp.float32


def test_int8_engine_greedy_and_tensor_parallel(qwen3_moe):
    """The engine's greedy continuations with int8 weights agree with unquantized ones (transformers'),
    up to their first difference, for a third of the tokens (a random model's near ties: its
    logits' argmax agree at 92% of positions, and a continuation differs from its first change
    on), and int4_asym at TP 2 (each expert's width split, its down projection's grouped scales and
    zero-point offsets with it) gives the model's greedy tokens exactly: each the argmax of the
    forward pass with the same weights on one device (no KV cache) after the tokens before it (the
    smallest top-2 logit gap there: 5e-4, of a spread of 1.1)."""
    d, ref = qwen3_moe
    cfg = ModelConfig.from_pretrained(d)
    int8 = greedy(LLM(model=d, quantization="int8", **ENGINE), cfg.vocab_size)
    prefix = [next((i for i, (a, b) in enumerate(zip(r, q)) if a != b), len(r)) for r, q in zip(ref, int8)]
    assert sum(prefix) >= NEW_TOKENS, (prefix, ref, int8)
    proc = subprocess.run([sys.executable, "-m", "tests.test_quantized_moe", d], cwd=ROOT,
                          capture_output=True, text=True, env=fake_devices_env(2), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tp = eval(proc.stdout.strip().splitlines()[-1])
    rows = np.array([p + t for p, t in zip(prompts(cfg.vocab_size), tp)])
    model = build_model(cfg)
    logits = model.apply({"params": load_params(d, cfg, quantization="int4_asym")}, rows,
                         np.broadcast_to(np.arange(rows.shape[1]), rows.shape), method=model.forward_logits)
    assert np.asarray(logits).argmax(-1)[:, PROMPT_TOKENS - 1:-1].tolist() == tp


if __name__ == "__main__":   # the int4_asym engine at TP 2 on fake devices: its greedy tokens
    model_dir = sys.argv[1]
    llm = LLM(model=model_dir, quantization="int4_asym", mesh={"model": 2}, **ENGINE)
    specs = jax.tree.map(lambda x: x.sharding.spec, llm.llm_engine.runner.params["model"]["layers_1"]["mlp"]["experts"])
    assert specs["down_proj"]["scale"][2] == specs["down_proj"]["zero"][2] == "model", specs
    print(greedy(llm, llm.llm_engine.model_cfg.vocab_size))
