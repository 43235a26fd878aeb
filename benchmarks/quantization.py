"""Quantized weights (int8 and int4 weight-only, w8a8) against unquantized, on the embedded tiny
model and a 100M model, in one process.

  * perplexity on the model's held-out text (the split of scripts/train_tiny_model.py),
    through the same forward pass as training (no KV cache);
  * greedy agreement: of each of the training script's sample prompts' first 32 greedy
    tokens through the engine, how many match unquantized (up to the first difference, and
    in all);
  * weight bytes measured from the loaded params (all, and the quantized Linear weights only);
  * decode step time at batch 1 and 16: the engines take one engine step each in turn,
    alternating rounds, and the ratio is of medians;
  * on the 100M model (random weights): logit error statistics, weight bytes, decode step time.

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

from benchmarks.common import (RESULTS_DIR, command_line, markdown_table, model_summary, prepare_model,
                               write_keeping_notes)
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
ENGINE = dict(max_num_seqs=16, max_model_len=512, kv_cache_mb=256, compilation_cache_dir=None)
BATCHES = (1, 16)   # decode steps timed at these batch sizes


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


def decode_step_seconds(engines: dict, rounds: int, batch: int = 1) -> dict:
    """Median seconds of a decode step with `batch` sequences per engine (LLMs keyed by mode),
    taken in alternating rounds."""
    params = SamplingParams(temperature=0.0, max_tokens=rounds + 32, ignore_eos=True)
    ids = {}
    for mode, llm in engines.items():
        engine = llm.llm_engine
        prompt = engine.tokenizer.encode(training_script().SAMPLE_PROMPTS[0])
        ids[mode] = [engine.add_request(prompt, params) for _ in range(batch)]
        for _ in range(8):   # the prefills, then decode steps until the pipeline is full
            engine.step()
    times = {mode: [] for mode in engines}
    for _ in range(rounds):
        for mode, llm in engines.items():
            start = time.perf_counter()
            llm.llm_engine.step()
            times[mode].append(time.perf_counter() - start)
    for mode, llm in engines.items():
        for request_id in ids[mode]:
            llm.llm_engine.abort(request_id)
        while llm.llm_engine.has_unfinished():
            llm.llm_engine.step()
    return {mode: float(np.median(t)) for mode, t in times.items()}


def logit_errors(model_dir: str, modes=quantization.MODES, tokens: int = 256, seed: int = 0) -> dict:
    """Per mode: logit error against unquantized over seeded random tokens (f32 forward pass, no
    cache): mean and max absolute error, the mean error over the logits' standard deviation,
    and how often the top-1 token is the same."""
    cfg = ModelConfig.from_pretrained(model_dir)
    model, params = build_model(cfg), load_params(model_dir, cfg)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, (1, tokens))
    positions = np.arange(tokens)[None]
    forward = jax.jit(lambda p: model.apply({"params": p}, ids, positions, method=model.forward_logits)[0])
    reference = np.asarray(forward(params))
    out = {}
    for mode in modes:
        logits = np.asarray(forward(quantization.quantize_params(params, mode)))
        err, top1 = np.abs(logits - reference), logits.argmax(-1) == reference.argmax(-1)
        out[mode] = {"mean_abs": float(err.mean()), "max_abs": float(err.max()),
                     "mean_over_std": float(err.mean() / reference.std()), "top1_same": float(top1.mean())}
    return out


def measure_engines(model_dir: str, rounds: int) -> tuple[dict, dict]:
    """The engines per mode, and per mode its weight bytes and decode step seconds per batch size."""
    engines = {mode: LLM(model=model_dir, quantization=mode, **ENGINE) for mode in MODES}
    steps = {batch: decode_step_seconds(engines, rounds, batch) for batch in BATCHES}
    rows = {}
    for mode, llm in engines.items():
        params = llm.llm_engine.runner.params
        rows[mode] = {"bytes": quantization.weight_bytes(params), "linear_bytes": linear_weight_bytes(params),
                      "step_s": {batch: steps[batch][mode] for batch in BATCHES}}
    return engines, rows


def size_and_speed(rows: dict) -> list[list]:
    """Per mode: all params' bytes, the Linear weights' against f32, the step time and speed-up."""
    base = rows[None]
    return [[f"{r['bytes'] / 2**20:.1f} MiB", f"{r['linear_bytes'] / base['linear_bytes']:.3f}x"]
            + [cell for b in BATCHES for cell in (f"{r['step_s'][b] * 1e3:.2f} ms",
                                                   f"{base['step_s'][b] / r['step_s'][b]:.2f}x")]
            for r in rows.values()]


SIZE_AND_SPEED = ["all params", "Linear weights vs f32"] + [
    cell for b in BATCHES for cell in (f"decode step (batch {b})", f"speed vs f32 (batch {b})")]


def tiny_table(rounds: int, max_windows: int | None) -> list[str]:
    ppl = heldout_perplexities(max_windows=max_windows)
    engines, rows = measure_engines(TINY_MODEL_DIR, rounds)
    tokens = {mode: greedy_tokens(llm) for mode, llm in engines.items()}
    table = []
    for (mode, llm), size in zip(engines.items(), size_and_speed(rows)):
        prefix, same = agreement(tokens[None], tokens[mode])
        n = AGREEMENT_TOKENS * len(prefix)
        table.append([mode or "none (f32)", f"{ppl[mode]:.3f}", f"{(ppl[mode] / ppl[None] - 1) * 100:+.2f}%",
                      f"{sum(prefix)}/{n} (shortest {min(prefix)})", f"{sum(same)}/{n}", *size])
    header = ["weights", "held-out ppl", "vs f32", "greedy agreement to first difference",
              "greedy agreement, all positions", *SIZE_AND_SPEED]
    return markdown_table(header, table, right_aligned=tuple(range(1, len(header))))


def model_100m_table(rounds: int, work_dir: str) -> list[str]:
    model_dir = prepare_model("100m", work_dir)
    errors = logit_errors(model_dir)
    _, rows = measure_engines(model_dir, rounds)
    table = []
    for (mode, r), size in zip(rows.items(), size_and_speed(rows)):
        e = errors.get(mode)
        cells = (["-"] * 4 if e is None else [f"{e['mean_abs']:.2e}", f"{e['max_abs']:.2e}",
                                              f"{e['mean_over_std']:.2e}", f"{e['top1_same'] * 100:.1f}%"])
        table.append([mode or "none (f32)", *cells, *size])
    header = ["weights", "logit mean abs error", "max abs error", "mean error / logit std", "same top-1",
              *SIZE_AND_SPEED]
    return [model_summary(model_dir), "", *markdown_table(header, table, right_aligned=tuple(range(1, len(header))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--max-windows", type=int, default=0, help="perplexity over the first N windows only (0: all)")
    p.add_argument("--work-dir", default="/tmp/jaxserve_bench", help="where the 100m model is built")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "quantization.md"))
    args = p.parse_args(argv)
    text = "\n".join([
        "# Quantized weights: int8 and int4 weight-only, and w8a8, against unquantized", "",
        f"Command: `{command_line('quantization', argv)}`. Machine: {MACHINE} (shared with other jobs: "
        f"absolute times are noisy; each model's engines take decode steps in {args.rounds} "
        "alternating rounds per batch size in one process, and the speed ratios are of the medians).", "",
        "## The embedded tiny model", "",
        "f32 on CPU; its embeddings, tied to the LM head, stay f32. Perplexity on its held-out topics "
        "(scripts/train_tiny_model.py's split, 128-token windows); agreement over the first 32 greedy "
        "tokens of the training script's sample prompts, through the engine.", "",
        *tiny_table(args.rounds, args.max_windows or None), "",
        "## The 100M model (random weights, f32)", "",
        "Logit errors over 256 seeded random tokens, one forward pass without a cache.", "",
        *model_100m_table(args.rounds, args.work_dir), ""])
    write_keeping_notes(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
