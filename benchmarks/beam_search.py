"""Beam search: jaxserve's LLM.beam_search (jaxserve/beam_search.py: rounds of one-token requests
over the prefix cache, as vLLM runs it) against transformers' generate(num_beams=k,
early_stopping="never") on the same float32 checkpoint and prompts, with jaxserve's greedy
generate of as many tokens beside them. Seconds (median of --rounds), the compilations of the
timed calls, and how many prompts' beams (all k, in order) equal transformers'.

  python -m benchmarks.beam_search [--model 100m] [--beam-width 4] [--max-tokens 32] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import (load_average, load_hf_model, markdown_table, model_run_args, model_summary,
                               prepare_model, publish)
from jaxserve import LLM, BeamSearchParams, SamplingParams
from jaxserve.compilations import CompileCounter


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_run_args(p)
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args(argv)
    import torch

    model_dir = prepare_model(args.model, args.work_dir)
    CompileCounter.install()
    llm = LLM(model=model_dir, dtype="float32", compilation_cache_dir=None)
    hf = load_hf_model(model_dir)
    vocab = llm.llm_engine.model_cfg.vocab_size
    prompts = np.random.default_rng(0).integers(3, vocab, (args.num_prompts, args.prompt_len)).tolist()
    beam = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def ours():
        return [[b.tokens[args.prompt_len:] for b in out.sequences] for out in llm.beam_search(prompts, beam)]

    def transformers():
        with torch.no_grad():
            out = hf.generate(torch.tensor(prompts), num_beams=args.beam_width, num_return_sequences=args.beam_width,
                              max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, early_stopping="never",
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        return np.asarray(out[:, args.prompt_len:]).reshape(args.num_prompts, args.beam_width, -1).tolist()

    ways = {"jaxserve LLM.beam_search": ours, "transformers generate(num_beams)": transformers,
            "jaxserve LLM.generate, greedy": lambda: llm.generate(prompts, greedy, use_tqdm=False)}
    results = {w: fn() for w, fn in ways.items()}   # untimed: compiles, fills caches
    seconds, compiles = {w: [] for w in ways}, dict.fromkeys(ways, 0)
    loads = [load_average()]
    for _ in range(args.rounds):
        for w, fn in ways.items():
            t, before = time.perf_counter(), CompileCounter.count
            fn()
            seconds[w].append(time.perf_counter() - t)
            compiles[w] += CompileCounter.count - before
    loads.append(load_average())
    same = sum(a == b for a, b in zip(results["jaxserve LLM.beam_search"], results["transformers generate(num_beams)"]))
    median = {w: statistics.median(s) for w, s in seconds.items()}
    base = median["transformers generate(num_beams)"]
    rows = [[w, f"{median[w]:.2f} s", ", ".join(f"{s:.2f}" for s in seconds[w]), f"{base / median[w]:.2f}x",
             str(compiles[w])] for w in ways]
    return publish(
        "Beam search: jaxserve against transformers", "beam_search", argv, args.out,
        f"Model: {model_summary(model_dir)}, float32. {args.num_prompts} prompts of {args.prompt_len} seeded random "
        f"ids, beam width {args.beam_width}, {args.max_tokens} new tokens (eos ignored), engine defaults. "
        f"Beams equal to transformers' (all {args.beam_width}, in order): {same} of {args.num_prompts} prompts. "
        f"Load average (1 min) before and after: {loads[0]:.1f}, {loads[1]:.1f}.", "",
        *markdown_table(["way", "median", "rounds (s)", "speed vs transformers' beam search", "compilations (timed)"],
                        rows, right_aligned=(1, 3, 4)))


if __name__ == "__main__":
    main()
