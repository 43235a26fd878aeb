"""Quantized weights (int8, int4, int4_asym and fp8 weight-only, w8a8; int8 and w8a8 with the LM head quantized
too, "+head") against unquantized, on the embedded tiny model and a 100M model, in one process.

  * perplexity on the model's held-out text (the split of scripts/train_tiny_model.py),
    through the same forward pass as training (no KV cache);
  * greedy agreement: of each of the training script's sample prompts' first 32 greedy
    tokens through the engine, how many match unquantized (up to the first difference, and
    in all);
  * weight bytes measured from the loaded params (all, and the quantized Linear weights only);
  * decode step time at batch 1 and 16: the engines take one engine step each in turn,
    alternating rounds, and the ratio is of medians;
  * on the 100M model (random weights): logit error statistics, weight bytes, decode step time,
    and the bytes a decode step reads over its time at batch 1 against the measured read bandwidth (MBU).

    python -m benchmarks.quantization [--rounds 200] [--max-windows 0] [--configs w8a8,w8a8+head] [--models 100m]
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time

import jax
import numpy as np

from benchmarks.common import (RESULTS_DIR, command_line, load_average, markdown_table, measured_peaks,
                               model_summary, prepare_model, write_keeping_notes)
from jaxserve import LLM, SamplingParams, quantization
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.models import build_model
from jaxserve.tokenizer import load_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD = "+head"   # a configuration's suffix: the LM head quantized too
CONFIGS = (None, *quantization.MODES, "int8" + HEAD, "w8a8" + HEAD)   # None: unquantized
AGREEMENT_TOKENS = 32
MACHINE = "2-core CPU dev box"
ENGINE = dict(max_num_seqs=16, max_model_len=512, kv_cache_mb=256, compilation_cache_dir=None)
BATCHES = (1, 16)   # decode steps timed at these batch sizes


def settings(config: str | None) -> dict:
    """A configuration's engine config keys: quantization and quantize_lm_head."""
    head = config is not None and config.endswith(HEAD)
    return {"quantization": config.removesuffix(HEAD) if head else config, "quantize_lm_head": head}


def quantized(params, config: str | None):
    s = settings(config)
    return quantization.quantize_params(params, s["quantization"], lm_head=s["quantize_lm_head"])


def label(config: str | None) -> str:
    return config or "none (f32)"


@functools.cache
def training_script():
    """scripts/train_tiny_model.py as a module: its corpus split, token stream and perplexity."""
    spec = importlib.util.spec_from_file_location("train_tiny_model", os.path.join(ROOT, "scripts", "train_tiny_model.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def heldout_perplexities(configs=CONFIGS, max_windows: int | None = None, seq_len: int = 128,
                         row_losses=None, params_of=None) -> dict:
    """Held-out perplexity of the tiny model per configuration (max_windows: of the first so
    many seq_len windows only, for a quicker look). `row_losses(params, tokens)` and
    `params_of(config)` replace, when given, the training script's row losses (jitted) and the
    checkpoint quantized per configuration (tests/test_quantized_engine.py passes its own forward
    pass, which also gives the argmax, and its cached params)."""
    script = training_script()
    cfg = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    stream = script.token_stream(load_tokenizer(TINY_MODEL_DIR), script.split_corpus(None)[1])
    if max_windows:
        stream = stream[:max_windows * seq_len + 1]
    row_losses = row_losses or jax.jit(script.make_row_losses(build_model(cfg)))
    params_of = params_of or functools.partial(quantized, load_params(TINY_MODEL_DIR, cfg))
    return {config: script.perplexity(row_losses, params_of(config), stream, seq_len) for config in configs}


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
    """Bytes of the Linear weights that quantization replaces by default (qweight + scale, or
    weight), the LM head's left out."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        if keys[0] != quantization.HEAD and (keys[-1] in quantization.LEAVES or quantization.quantizable(keys, leaf)):
            total += leaf.size * leaf.dtype.itemsize
    return total


def step_bytes(params, tied: bool) -> int:
    """Bytes a decode step reads: every param, but the embedding table where another array is the
    LM head (untied, or tied and quantized: tied_head), as then the step only gathers a few rows."""
    table = quantization.node(params, quantization.TIED_EMBEDDING)
    gathered = not tied or quantization.HEAD in params
    return quantization.weight_bytes(params) - (table.size * table.dtype.itemsize if gathered else 0)


def decode_step_seconds(engines: dict, rounds: int, batch: int = 1) -> dict:
    """Median seconds of a decode step with `batch` sequences per engine (LLMs keyed by configuration),
    taken in alternating rounds."""
    params = SamplingParams(temperature=0.0, max_tokens=rounds + 32, ignore_eos=True)
    ids = {}
    for config, llm in engines.items():
        engine = llm.llm_engine
        prompt = engine.tokenizer.encode(training_script().SAMPLE_PROMPTS[0])
        ids[config] = [engine.add_request(prompt, params) for _ in range(batch)]
        for _ in range(8):   # the prefills, then decode steps until the pipeline is full
            engine.step()
    times = {config: [] for config in engines}
    for _ in range(rounds):
        for config, llm in engines.items():
            start = time.perf_counter()
            llm.llm_engine.step()
            times[config].append(time.perf_counter() - start)
    for config, llm in engines.items():
        for request_id in ids[config]:
            llm.llm_engine.abort(request_id)
        while llm.llm_engine.has_unfinished():
            llm.llm_engine.step()
    return {config: float(np.median(t)) for config, t in times.items()}


def logit_errors(model_dir: str, configs, tokens: int = 256, seed: int = 0) -> dict:
    """Per configuration: logit error against unquantized over seeded random tokens (f32 forward pass, no
    cache): mean and max absolute error, the mean error over the logits' standard deviation,
    and how often the top-1 token is the same."""
    cfg = ModelConfig.from_pretrained(model_dir)
    model, params = build_model(cfg), load_params(model_dir, cfg)
    ids = np.random.default_rng(seed).integers(3, cfg.vocab_size, (1, tokens))
    positions = np.arange(tokens)[None]
    forward = jax.jit(lambda p: model.apply({"params": p}, ids, positions, method=model.forward_logits)[0])
    reference = np.asarray(forward(params))
    out = {}
    for config in configs:
        logits = np.asarray(forward(quantized(params, config)))
        err, top1 = np.abs(logits - reference), logits.argmax(-1) == reference.argmax(-1)
        out[config] = {"mean_abs": float(err.mean()), "max_abs": float(err.max()),
                     "mean_over_std": float(err.mean() / reference.std()), "top1_same": float(top1.mean())}
    return out


def measure_engines(model_dir: str, configs, rounds: int) -> tuple[dict, dict]:
    """The engines per configuration, and per configuration its weight bytes (all, the Linears'
    and a decode step's) and decode step seconds per batch size."""
    engines = {config: LLM(model=model_dir, **settings(config), **ENGINE) for config in configs}
    steps = {batch: decode_step_seconds(engines, rounds, batch) for batch in BATCHES}
    rows = {}
    for config, llm in engines.items():
        params, tied = llm.llm_engine.runner.params, llm.llm_engine.model_cfg.tie_word_embeddings
        rows[config] = {"bytes": quantization.weight_bytes(params), "linear_bytes": linear_weight_bytes(params),
                        "step_bytes": step_bytes(params, tied),
                        "step_s": {batch: steps[batch][config] for batch in BATCHES}}
    return engines, rows


def size_and_speed(rows: dict) -> list[list]:
    """Per configuration: all params' bytes, the Linear weights' against f32, the step time and speed-up."""
    base = rows[None]
    return [[f"{r['bytes'] / 2**20:.1f} MiB", f"{r['linear_bytes'] / base['linear_bytes']:.3f}x"]
            + [cell for b in BATCHES for cell in (f"{r['step_s'][b] * 1e3:.2f} ms",
                                                   f"{base['step_s'][b] / r['step_s'][b]:.2f}x")]
            for r in rows.values()]


SIZE_AND_SPEED = ["all params", "Linear weights vs f32"] + [
    cell for b in BATCHES for cell in (f"decode step (batch {b})", f"speed vs f32 (batch {b})")]


def tiny_table(configs, rounds: int, max_windows: int | None) -> list[str]:
    ppl = heldout_perplexities(configs, max_windows=max_windows)
    engines, rows = measure_engines(TINY_MODEL_DIR, configs, rounds)
    tokens = {config: greedy_tokens(llm) for config, llm in engines.items()}
    table = []
    for (config, llm), size in zip(engines.items(), size_and_speed(rows)):
        prefix, same = agreement(tokens[None], tokens[config])
        n = AGREEMENT_TOKENS * len(prefix)
        table.append([label(config), f"{ppl[config]:.3f}", f"{(ppl[config] / ppl[None] - 1) * 100:+.2f}%",
                      f"{sum(prefix)}/{n} (shortest {min(prefix)})", f"{sum(same)}/{n}", *size])
    header = ["weights", "held-out ppl", "vs f32", "greedy agreement to first difference",
              "greedy agreement, all positions", *SIZE_AND_SPEED]
    return markdown_table(header, table, right_aligned=tuple(range(1, len(header))))


def model_100m_table(configs, rounds: int, work_dir: str) -> list[str]:
    model_dir = prepare_model("100m", work_dir)
    errors = logit_errors(model_dir, [c for c in configs if c is not None])
    load, peaks = [load_average()], [measured_peaks()]
    _, rows = measure_engines(model_dir, configs, rounds)
    load.append(load_average())
    peaks.append(measured_peaks())
    peak = max(p.bandwidth for p in peaks)   # the VM's read bandwidth drifts (benchmarks/results/roofline_cpu.md)
    table = []
    for (config, r), size in zip(rows.items(), size_and_speed(rows)):
        e = errors.get(config)
        cells = (["-"] * 4 if e is None else [f"{e['mean_abs']:.2e}", f"{e['max_abs']:.2e}",
                                              f"{e['mean_over_std']:.2e}", f"{e['top1_same'] * 100:.1f}%"])
        bandwidth = r["step_bytes"] / r["step_s"][1]
        table.append([label(config), *cells, *size, f"{r['step_bytes'] / 1e6:.1f} MB",
                      f"{bandwidth / 1e9:.1f} GB/s", f"{bandwidth / peak * 100:.0f}%"])
    header = ["weights", "logit mean abs error", "max abs error", "mean error / logit std", "same top-1",
              *SIZE_AND_SPEED, "bytes read per step", "read rate (batch 1)", "MBU (batch 1)"]
    return [model_summary(model_dir), "",
            f"Load average (1 min) before and after the engines' steps: {load[0]:.1f}, {load[1]:.1f}. MBU: against "
            f"{peak / 1e9:.1f} GB/s, the higher of the read bandwidths before and after the steps "
            f"({', '.join(f'{p.bandwidth / 1e9:.1f}' for p in peaks)} GB/s, {peaks[0].source}).", "",
            *markdown_table(header, table, right_aligned=tuple(range(1, len(header))))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--max-windows", type=int, default=0, help="perplexity over the first N windows only (0: all)")
    p.add_argument("--work-dir", default="/tmp/jaxserve_bench", help="where the 100m model is built")
    p.add_argument("--configs", default=",".join(CONFIGS[1:]),
                   help="the quantized configurations to run, comma-separated (unquantized, the reference, always runs)")
    p.add_argument("--models", default="tiny,100m", help="tiny, 100m or both (comma-separated)")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "quantization.md"))
    args = p.parse_args(argv)
    configs = [None] + [c for c in CONFIGS[1:] if c in args.configs.split(",")]
    models = args.models.split(",")
    # the 100M model first: its step times are the figures that matter, taken while the box is freshest
    large = [] if "100m" not in models else [
        "## The 100M model (random weights, f32)", "",
        "Logit errors over 256 seeded random tokens, one forward pass without a cache.", "",
        *model_100m_table(configs, args.rounds, args.work_dir), ""]
    tiny = [] if "tiny" not in models else [
        "## The embedded tiny model", "",
        "f32 on CPU; its embeddings, tied to the LM head, stay f32 (+head: the head is a quantized copy of them). "
        "Perplexity on its held-out topics (scripts/train_tiny_model.py's split, 128-token windows); agreement "
        "over the first 32 greedy tokens of the training script's sample prompts, through the engine.", "",
        *tiny_table(configs, args.rounds, args.max_windows or None), ""]
    text = "\n".join([
        "# Quantized weights: int8, int4 and fp8 weight-only, and w8a8 (+head: the LM head too), against unquantized", "",
        f"Command: `{command_line('quantization', argv)}`. Machine: {MACHINE} (shared with other jobs: "
        f"absolute times are noisy; each model's engines take decode steps in {args.rounds} "
        "alternating rounds per batch size in one process, and the speed ratios are of the medians).", "",
        *tiny, *large])
    write_keeping_notes(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
