"""Speculative decoding with n-gram prompt lookup against none, side by side in one process.

The embedded tiny model, greedy, on Python-docs prompts (its training text). For each batch size
the engines run in alternating rounds: without speculation, then with k = 2 and k = 4 proposals.
Reported: output tokens/s, how much faster than without, the acceptance rate (accepted /
proposed), accepted tokens per verify row, and tokens per engine step.

    python -m benchmarks.spec_decode [--rounds 2] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import time

from benchmarks.common import RESULTS_DIR, command_line, machine_info, machine_line, markdown_table, write_text
from jaxserve import LLM, SamplingParams

PROMPTS = ["The for statement is used to", "def square(x):\n    return x * x\n\ndef cube(x):\n",
           "A list is a sequence. A list is", "import os\nimport sys\nimport", "The with statement",
           "Exceptions are raised when", "class Point:\n    def __init__(self, x, y):\n", "The while loop"]
ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_size=128, max_prefill_seqs=2,
              max_model_len=512, kv_cache_mb=64, compilation_cache_dir=None)
SPEC_KS = (2, 4)


def run(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, dict]:
    """Seconds for the batch, and the engine's counters' increase."""
    stats = llm.llm_engine.stats
    before = dict(stats)
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start, {k: stats[k] - before[k] for k in stats}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    engines = {0: LLM(**ENGINE)}
    engines.update({k: LLM(**ENGINE, speculative={"method": "ngram", "num_tokens": k, "ngram_min": 1,
                                                  "ngram_max": 3}) for k in SPEC_KS})
    for llm in engines.values():
        llm.llm_engine.warmup()
    rows = []
    for batch in (1, 16):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        totals = {k: [0.0, {}] for k in engines}
        for _ in range(args.rounds):
            for k, llm in engines.items():
                seconds, counts = run(llm, prompts, args.max_tokens)
                totals[k][0] += seconds
                totals[k][1] = {c: totals[k][1].get(c, 0) + v for c, v in counts.items()}
        base = totals[0][1]["generation_tokens"] / totals[0][0]
        for k, (seconds, c) in totals.items():
            rate = c["generation_tokens"] / seconds
            rows.append([batch, k or "off", f"{rate:.1f}", f"{rate / base:.2f}x",
                         f"{c['spec_accepted_tokens'] / c['spec_proposed_tokens']:.2f}" if k else "-",
                         f"{c['spec_accepted_tokens'] / c['spec_verify_rows']:.2f}" if k else "-",
                         f"{c['generation_tokens'] / c['steps']:.2f}"])
    lines = ["# Speculative decoding: n-gram prompt lookup (issue 16)", "",
             f"Command: `{command_line('spec_decode', argv)}`", "", machine_line(machine_info()), "",
             f"Embedded tiny model, greedy, {args.max_tokens} new tokens per prompt, prompts from the Python docs "
             f"(its training text), {args.rounds} alternating rounds per engine, totals over the rounds.", "",
             *markdown_table(["batch", "k", "tokens/s", "vs off", "acceptance", "accepted per verify row",
                              "tokens per step"], rows), ""]
    write_text(f"{RESULTS_DIR}/spec_decode.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
