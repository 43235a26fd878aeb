"""Mixture of experts on CPU, side by side in one run:
  * one MoE layer (top-2 of 8 SwiGLU experts) at 1, 16 and 128 token rows: the path jaxserve takes
    on CPU (every expert for every token, zero-weighted where not routed), the grouped ragged_dot
    path TPUs take (as XLA:CPU lowers it), and dense SwiGLU MLPs of the same active
    width (2 experts') and of the same total width (8 experts');
  * engine decode steps (median ms, batch 1 and 16) of a small Mixtral and of a Mistral with the
    same active parameter count (its MLP as wide as two experts), random weights written with
    jaxserve's save_pretrained, configs/tiny-cpu.yaml's engine settings.

  python -m benchmarks.moe_cpu [--steps 100] [--out benchmarks/results/moe_cpu.md]
"""
from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import common
from benchmarks.step_timing import decode_ms
from jaxserve import checkpoint, roofline
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.models import init_params
from jaxserve.models.layers import GatedMLP, SparseMoE, every_expert, gated, grouped_experts, route

HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH = 512, 8, 2, 1024
ROWS = (1, 16, 128)
ATTENTION = dict(vocab_size=4096, hidden_size=HIDDEN, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1,
                 eos_token_id=2, tie_word_embeddings=False, dtype="float32")
MODELS = {   # HF config.json of each engine model
    "Mixtral, top-2 of 8 experts of 1024": dict(
        ATTENTION, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=EXPERT_WIDTH,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K),
    "Mistral, MLP 2048 (same active params)": dict(
        ATTENTION, architectures=["MistralForCausalLM"], model_type="mistral", intermediate_size=TOP_K * EXPERT_WIDTH),
}


def layer_rows() -> dict[str, list[float]]:
    """ms per call (best of 20) of each layer variant at each row count."""
    moe = SparseMoE(EXPERTS, TOP_K, EXPERT_WIDTH, True)
    x0 = jnp.ones((1, HIDDEN))
    moe_params = moe.init(jax.random.key(0), x0)

    def moe_through(path):   # SparseMoE's routing, then `path`
        def apply(params, x):
            experts = params["params"]["experts"]
            weights, chosen = route(x @ params["params"]["gate"]["weight"].T, TOP_K, True)
            return path(x, weights, chosen, experts, glu=gated(jax.nn.silu))
        return jax.jit(apply), moe_params

    def dense(width):
        mlp = GatedMLP(HIDDEN, width, False)
        return jax.jit(mlp.apply), mlp.init(jax.random.key(1), x0)

    variants = {"MoE, every expert (jaxserve on CPU and GPU)": moe_through(every_expert),
                "MoE, grouped ragged_dot (TPU's path)": moe_through(grouped_experts),
                f"dense MLP {TOP_K * EXPERT_WIDTH} (same active)": dense(TOP_K * EXPERT_WIDTH),
                f"dense MLP {EXPERTS * EXPERT_WIDTH} (same total)": dense(EXPERTS * EXPERT_WIDTH)}
    out = {}
    for name, (fn, params) in variants.items():
        xs = [jax.random.normal(jax.random.key(t), (t, HIDDEN)) for t in ROWS]
        out[name] = [1e3 * roofline.best_seconds(fn, params, x, iters=20) for x in xs]
    return out


def engine_rows(steps: int) -> dict[str, tuple[int, int, float, float]]:
    """(params, active params, decode ms at batch 1, at batch 16) of each engine model."""
    out = {}
    for name, hf in MODELS.items():
        with tempfile.TemporaryDirectory() as d:
            cfg = ModelConfig.from_hf_dict(hf)
            checkpoint.save_pretrained(init_params(cfg, jax.random.key(0)), hf, d)
            common.save_word_tokenizer(d, hf["vocab_size"])
            ecfg = EngineConfig.from_yaml(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny-cpu.yaml"),
                                          model=d, compilation_cache_dir=None)
            engine = LLMEngine(ecfg)
            engine.warmup()
            out[name] = (cfg.num_params, cfg.num_active_params, decode_ms(engine, 1, steps), decode_ms(engine, 16, steps))
            del engine
    return out


def markdown(command: str, machine: dict, layers: dict, engines: dict, load: list[float]) -> str:
    lines = ["# Mixture of experts on CPU", "", f"Command: `{command}`  ", common.machine_line(machine), "",
             f"Load average {common.load_change(load)} (the box is shared: compare rows of this run).", "",
             f"One layer, hidden {HIDDEN}, float32, ms per call (best of 20):", ""]
    lines += common.markdown_table(["layer"] + [f"{t} rows" for t in ROWS],
                                   [[name] + [f"{ms:.2f}" for ms in times] for name, times in layers.items()],
                                   right_aligned=tuple(range(1, len(ROWS) + 1)))
    lines += ["", "Engine decode steps (configs/tiny-cpu.yaml, 4 layers, hidden 512, vocab 4096, float32), "
              "median ms:", ""]
    lines += common.markdown_table(["model", "params", "active params", "batch 1", "batch 16"],
                                   [[name, f"{n / 1e6:.1f}M", f"{a / 1e6:.1f}M", f"{b1:.2f}", f"{b16:.2f}"]
                                    for name, (n, a, b1, b16) in engines.items()], right_aligned=(1, 2, 3, 4))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default=os.path.join(common.RESULTS_DIR, "moe_cpu.md"))
    args = p.parse_args(argv)
    machine, start = common.machine_info(), common.load_average()
    layers, engines = layer_rows(), engine_rows(args.steps)
    text = markdown(common.command_line("moe_cpu", argv), machine, layers, engines, [start, common.load_average()])
    print(text)
    common.write_keeping_notes(args.out, text)


if __name__ == "__main__":
    main()
