"""Weight-only int8 and int4 against unquantized, on the embedded tiny model, in one process.

  * perplexity on the model's held-out text (the split of scripts/train_tiny_model.py),
    through the same forward pass as training (no KV cache);
  * greedy agreement: of each of the training script's sample prompts' first 32 greedy
    tokens through the engine, how many match unquantized (up to the first difference, and
    in all);
  * weight bytes measured from the loaded params (all, and the quantized Linear weights only);
  * decode step time at batch 1: the engines take one engine step each in turn, alternating
    rounds, and the ratio is of medians.

    python -m benchmarks.quantization [--rounds 200] [--max-windows 0]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time

import jax
import numpy as np

from benchmarks.common import RESULTS_DIR, command_line, markdown_table, write_text
from jaxserve import LLM, SamplingParams, quantization
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.models import build_model
from jaxserve.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = (None, *quantization.MODES)
AGREEMENT_TOKENS = 32
MACHINE = "2-core CPU dev box"
ENGINE = dict(max_num_seqs=4, max_model_len=512, kv_cache_mb=16, compilation_cache_dir=None)


@functools.cache
def training_script():
    """scripts/train_tiny_model.py as a module: its corpus split, token stream and perplexity."""
    spec = importlib.util.spec_from_file_location("train_tiny_model", os.path.join(ROOT, "scripts", "train_tiny_model.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def heldout_perplexities(modes=MODES, max_windows: int | None = None, seq_len: int = 128) -> dict:
    """Held-out perplexity of the tiny model per quantization mode (max_windows: of the first so
    many seq_len windows only, for a quicker look)."""
    script = training_script()
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    stream = script.token_stream(load_tokenizer(TINY_MODEL_DIR), script.split_corpus(None)[1])
    if max_windows:
        stream = stream[:max_windows * seq_len + 1]
    row_losses = jax.jit(script.make_row_losses(build_model(cfg)))
    params = load_params(TINY_MODEL_DIR, cfg)
    return {mode: script.perplexity(row_losses, quantization.quantize_params(params, mode), stream, seq_len)
            for mode in modes}


def greedy_tokens(llm: LLM) -> list[list[int]]:
    out = llm.generate(training_script().SAMPLE_PROMPTS,
                       SamplingParams(temperature=0.0, max_tokens=AGREEMENT_TOKENS, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def agreement(reference: list[list[int]], tokens: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per prompt: tokens equal before the first difference, and equal positions in all."""
    prefix = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(reference, tokens)]
    same = [sum(a == b for a, b in zip(r, t)) for r, t in zip(reference, tokens)]
    return prefix, same


def linear_weight_bytes(params) -> int:
    """Bytes of the Linear weights that quantization replaces (qweight + scale, or weight)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        if keys[-1] in quantization.LEAVES or quantization.quantizable(keys, leaf):
            total += leaf.size * leaf.dtype.itemsize
    return total


def decode_step_seconds(engines: dict, rounds: int) -> dict:
    """Median seconds of a batch-1 decode step per engine, taken in alternating rounds."""
    params = SamplingParams(temperature=0.0, max_tokens=rounds + 8, ignore_eos=True)
    for llm in engines.values():
        engine = llm.llm_engine
        engine.add_request(engine.tokenizer.encode(training_script().SAMPLE_PROMPTS[0]), params)
        for _ in range(3):   # the prefill, then decode steps until the pipeline is full
            engine.step()
    times = {mode: [] for mode in engines}
    for _ in range(rounds):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.llm_engine.step()
            times[mode].append(time.perf_counter() - start)
    return {mode: float(np.median(t)) for mode, t in times.items()}


def measure(rounds: int, max_windows: int | None) -> dict:
    ppl = heldout_perplexities(max_windows=max_windows)
    engines = {mode: LLM(quantization=mode, **ENGINE) for mode in MODES}
    tokens = {mode: greedy_tokens(llm) for mode, llm in engines.items()}
    rows = {}
    for mode, llm in engines.items():
        params = llm.llm_engine.runner.params
        rows[mode] = {"perplexity": ppl[mode], "agreement": agreement(tokens[None], tokens[mode]),
                      "bytes": quantization.weight_bytes(params), "linear_bytes": linear_weight_bytes(params)}
    steps = decode_step_seconds(engines, rounds)
    for mode in MODES:
        rows[mode]["step_s"] = steps[mode]
    return rows


def markdown(rows: dict, command: str, rounds: int) -> str:
    base = rows[None]
    table = []
    for mode, r in rows.items():
        prefix, same = r["agreement"]
        table.append([mode or "none (f32)", f"{r['perplexity']:.3f}", f"{(r['perplexity'] / base['perplexity'] - 1) * 100:+.2f}%",
                      f"{sum(prefix)}/{AGREEMENT_TOKENS * len(prefix)} ({min(prefix)} min)", f"{sum(same)}/{AGREEMENT_TOKENS * len(same)}",
                      f"{r['bytes'] / 2**20:.2f} MiB", f"{r['linear_bytes'] / base['linear_bytes']:.3f}x",
                      f"{r['step_s'] * 1e3:.2f} ms", f"{base['step_s'] / r['step_s']:.2f}x"])
    header = ["weights", "held-out ppl", "vs f32", "greedy agreement to first difference",
              "greedy agreement, all positions", "all params", "Linear weights vs f32", "decode step (batch 1)",
              "speed vs f32"]
    return "\n".join([
        "# Weight-only quantization: int8 and int4 against unquantized", "",
        f"Command: `{command}`. Machine: {MACHINE} (shared with other jobs: absolute times are noisy; "
        f"the speed ratios come from {rounds} alternating rounds in one process, medians).", "",
        "The embedded tiny model (f32 on CPU; embeddings, tied to the LM head, stay f32). Perplexity "
        "on its held-out topics; agreement over the first 32 greedy tokens of the training script's "
        "sample prompts, through the engine.", "",
        *markdown_table(header, table, right_aligned=tuple(range(1, len(header)))), ""])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--max-windows", type=int, default=0, help="perplexity over the first N windows only (0: all)")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "quantization.md"))
    args = p.parse_args(argv)
    text = markdown(measure(args.rounds, args.max_windows or None), command_line("quantization", argv), args.rounds)
    write_text(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
