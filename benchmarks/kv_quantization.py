"""KV cache int8 and fp8 (e4m3) against the model dtype, through the engine, in one process.

  * held-out perplexity of the embedded tiny model: the prompt logprobs of 128-token windows of
    its held-out text (scripts/train_tiny_model.py's split), computed by the engine's prefill
    steps, which read every window's K/V back from the (quantized) pages;
  * greedy agreement over the first 32 tokens of the training script's sample prompts;
  * memory: bytes per page, pages at the same kv_cache_mb, and the most sequences running at
    once when more long requests arrive than the unquantized pool holds;
  * decode step time at batch 1 and at batch 16, alternating rounds, ratios of medians.

    python -m benchmarks.kv_quantization [--rounds 100] [--max-windows 0]
"""
from __future__ import annotations

import argparse
import os

import numpy as np

from benchmarks.common import RESULTS_DIR, command_line, markdown_table, write_keeping_notes
from benchmarks.quantization import (AGREEMENT_TOKENS, MACHINE, agreement, decode_step_seconds, greedy_tokens,
                                     training_script)
from jaxserve import LLM, SamplingParams
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.kv_cache import page_bytes_per_chip
from jaxserve.tokenizer import load_tokenizer

KV_DTYPES = ("auto", "int8", "fp8")
ENGINE = dict(max_num_seqs=16, max_model_len=512, kv_cache_mb=2, compilation_cache_dir=None)
WINDOW = 128


def engines() -> dict[str, LLM]:
    """One engine per KV dtype, warmed up (every step shape compiled before anything is timed)."""
    llms = {kv: LLM(kv_cache_dtype=kv, **ENGINE) for kv in KV_DTYPES}
    for llm in llms.values():
        llm.llm_engine.warmup()
    return llms


def heldout_windows(max_windows: int | None) -> list[list[int]]:
    script = training_script()
    stream = script.token_stream(load_tokenizer(TINY_MODEL_DIR), script.split_corpus(None)[1])
    n = (len(stream) - 1) // WINDOW
    windows = [stream[i * WINDOW:(i + 1) * WINDOW + 1].tolist() for i in range(n)]
    return windows[:max_windows] if max_windows else windows


def engine_perplexity(llm: LLM, windows: list[list[int]]) -> float:
    """exp(mean next-token loss) from the prompt logprobs of each window (its first token has none)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    logprobs = [lp[tok].logprob for out, w in zip(outs, windows) for lp, tok in zip(out.prompt_logprobs[1:], w[1:])]
    return float(np.exp(-np.mean(logprobs)))


def most_running(llm: LLM, num_requests: int = 32, prompt_tokens: int = 384, max_tokens: int = 8) -> int:
    """The most sequences running at once with `num_requests` long requests submitted together."""
    engine = llm.llm_engine
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(num_requests):
        engine.add_request(rng.integers(3, 4096, prompt_tokens).tolist(), params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.scheduler.num_running)
    return most


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--max-windows", type=int, default=0, help="perplexity over the first N windows only (0: all)")
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "kv_quantization.md"))
    args = p.parse_args(argv)
    llms = engines()
    windows = heldout_windows(args.max_windows or None)
    ppl = {kv: engine_perplexity(llm, windows) for kv, llm in llms.items()}
    tokens = {kv: greedy_tokens(llm) for kv, llm in llms.items()}
    running = {kv: most_running(llm) for kv, llm in llms.items()}
    steps = {b: decode_step_seconds(llms, args.rounds, b) for b in (1, 16)}
    cfg = llms["auto"].llm_engine.model_cfg
    quality, memory = [], []
    for kv, llm in llms.items():
        prefix, same = agreement(tokens["auto"], tokens[kv])
        n = AGREEMENT_TOKENS * len(prefix)
        quality.append([kv, f"{ppl[kv]:.3f}", f"{(ppl[kv] / ppl['auto'] - 1) * 100:+.2f}%",
                        f"{sum(prefix)}/{n} (shortest {min(prefix)})", f"{sum(same)}/{n}"])
        page = page_bytes_per_chip(cfg, np.float32, llm.llm_engine.runner.page_size, 1, tpu=False, kv_cache_dtype=kv)
        pages = llm.llm_engine.runner.num_pages
        memory.append([kv, f"{page:,}", f"{pages:,}", f"{pages / llms['auto'].llm_engine.runner.num_pages:.2f}x",
                       str(running[kv]),
                       *[f"{steps[b][kv] * 1e3:.2f} ms ({steps[b]['auto'] / steps[b][kv]:.2f}x)" for b in steps]])
    text = "\n".join([
        "# KV cache int8 and fp8 (e4m3) against the model dtype", "",
        f"Command: `{command_line('kv_quantization', argv)}`. Machine: {MACHINE} (shared with other jobs: "
        f"absolute times are noisy; the engines take decode steps in {args.rounds} alternating rounds in one "
        "process and the speed ratios are of the medians).", "",
        "Embedded tiny model, float32 weights and activations (head_dim 32), attention backend xla, "
        f"engine {ENGINE}. Scales: one float32 per token and KV head (jaxserve/kv_cache.py).", "",
        f"Perplexity: the engine's prompt logprobs over {len(windows)} held-out windows of {WINDOW} tokens "
        "(each window's K/V read back from the pages). Agreement: the first 32 greedy tokens of the "
        "training script's sample prompts against the float32 cache.", "",
        *markdown_table(["KV cache", "held-out ppl", "vs float32", "greedy agreement to first difference",
                         "greedy agreement, all positions"], quality, right_aligned=(1, 2, 3, 4)), "",
        "Memory at the same kv_cache_mb, and speed. Most running: 32 requests of 384 prompt tokens + 8 "
        "output tokens submitted at once (max_num_seqs 16).", "",
        *markdown_table(["KV cache", "bytes per page (all layers, K+V, scales)", "pages", "pages vs float32",
                         "most running", "decode step, batch 1", "decode step, batch 16"], memory,
                        right_aligned=(1, 2, 3, 4, 5, 6)), ""])
    write_keeping_notes(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
