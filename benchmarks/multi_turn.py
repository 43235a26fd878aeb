"""Conversations turn after turn: each turn's prompt is the last turn's prompt, its answer and a new
user message, as a chat client sends them. With prefix caching each turn computes only what is new:
full pages, and since 1383d0e the page the last turn ended inside (jaxserve/block_manager.py's
partial pages). Against the same run with prefix caching off, side by side: per turn, the
seconds for all conversations, the prompt tokens computed and found cached, and how many of the
cached ones the partial pages held (cached tokens past the last full page).

  python -m benchmarks.multi_turn [--model 100m] [--conversations 8] [--turns 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import load_average, markdown_table, model_run_args, model_summary, prepare_model, publish
from jaxserve import LLM, SamplingParams


def converse(llm: LLM, firsts: list[list[int]], turns: int, answer: int, message: list[list[int]]) -> list[tuple]:
    """Per turn: (seconds, prompt tokens, cached prompt tokens, cached tokens past the last full page)."""
    params = SamplingParams(temperature=0.0, max_tokens=answer, ignore_eos=True)
    page = llm.llm_engine.ecfg.page_size
    prompts, rows = [list(p) for p in firsts], []
    for turn in range(turns):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        cached = [o.num_cached_tokens for o in outs]
        rows.append((seconds, sum(map(len, prompts)), sum(cached), sum(c % page for c in cached)))
        prompts = [p + o.outputs[0].token_ids + message[turn] for p, o in zip(prompts, outs)]
    return rows


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_run_args(p)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=200)
    p.add_argument("--answer-len", type=int, default=37)
    p.add_argument("--message-len", type=int, default=21)
    args = p.parse_args(argv)
    model_dir = prepare_model(args.model, args.work_dir)
    ways = {"prefix caching": True, "no prefix caching": False}
    llms = {w: LLM(model=model_dir, dtype="float32", enable_prefix_caching=on, compilation_cache_dir=None)
            for w, on in ways.items()}
    rng = np.random.default_rng(0)
    vocab = llms["prefix caching"].llm_engine.model_cfg.vocab_size
    firsts = rng.integers(3, vocab, (args.conversations, args.first_len)).tolist()
    message = rng.integers(3, vocab, (args.turns, args.message_len)).tolist()
    for llm in llms.values():   # untimed: compiles
        converse(llm, firsts, args.turns, args.answer_len, message)
    runs = {w: [] for w in ways}
    loads = [load_average()]
    for _ in range(args.rounds):
        for w, llm in llms.items():
            llm.reset_prefix_cache()   # each round's first turn starts cold
            runs[w].append(converse(llm, firsts, args.turns, args.answer_len, message))
    loads.append(load_average())
    rows = []
    for turn in range(args.turns):
        seconds = {w: statistics.median(r[turn][0] for r in runs[w]) for w in ways}
        _, prompt, cached, partial = runs["prefix caching"][-1][turn]
        rows.append([str(turn + 1), str(prompt), str(prompt - cached), str(cached), str(partial),
                     f"{seconds['prefix caching']:.2f} s", f"{seconds['no prefix caching']:.2f} s",
                     f"{seconds['no prefix caching'] / seconds['prefix caching']:.2f}x"])
    page = llms["prefix caching"].llm_engine.ecfg.page_size
    return publish(
        "Conversations turn after turn: prefix caching with partial pages", "multi_turn", argv, args.out,
        f"Model: {model_summary(model_dir)}, float32, engine defaults (pages of {page} tokens). "
        f"{args.conversations} conversations generated together, each turn's prompt the last one's, its "
        f"{args.answer_len}-token greedy answer and a {args.message_len}-token message; the first prompt "
        f"{args.first_len} seeded random ids. Seconds: medians of {args.rounds} rounds, the prefix cache reset "
        f"before each. Load average (1 min) before and after: {loads[0]:.1f}, {loads[1]:.1f}.", "",
        *markdown_table(["turn", "prompt tokens", "computed", "cached", "of them in partial pages",
                         "time, caching", "time, no caching", "speed-up"], rows, right_aligned=range(8)))


if __name__ == "__main__":
    main()
