"""Speculative decoding, n-gram prompt lookup and a draft model, against none, side by side in
one process.

The embedded tiny model (its draft: jaxserve/assets/tiny/draft), greedy, on Python-docs prompts
(its training text). For each batch size the engines run in alternating rounds: without
speculation, then each proposer with k = 2 and k = 4 proposals. Reported: output tokens/s, how
much faster than without, the acceptance rate (accepted / proposed), accepted tokens per verify
row, tokens per engine step, and draft-model steps per engine step.

    python -m benchmarks.spec_decode [--rounds 2] [--max-tokens 128] [--batches 1 4 16]
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
NGRAM = {"method": "ngram", "ngram_min": 1, "ngram_max": 3}
DRAFT = {"method": "draft"}


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
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = p.parse_args(argv)
    engines = {("off", 0): LLM(**ENGINE)}
    for name, spec in (("ngram", NGRAM), ("draft", DRAFT)):
        engines.update({(name, k): LLM(**ENGINE, speculative={**spec, "num_tokens": k}) for k in SPEC_KS})
    for llm in engines.values():
        llm.llm_engine.warmup()
    rows = []
    for batch in args.batches:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        totals = {key: [0.0, {}] for key in engines}
        for _ in range(args.rounds):
            for key, llm in engines.items():
                seconds, counts = run(llm, prompts, args.max_tokens)
                totals[key][0] += seconds
                totals[key][1] = {c: totals[key][1].get(c, 0) + v for c, v in counts.items()}
        base = totals["off", 0][1]["generation_tokens"] / totals["off", 0][0]
        for (name, k), (seconds, c) in totals.items():
            rate = c["generation_tokens"] / seconds
            rows.append([batch, name, k or "-", f"{rate:.1f}", f"{rate / base:.2f}x",
                         f"{c['spec_accepted_tokens'] / c['spec_proposed_tokens']:.2f}" if k else "-",
                         f"{c['spec_accepted_tokens'] / c['spec_verify_rows']:.2f}" if k else "-",
                         f"{c['generation_tokens'] / c['steps']:.2f}",
                         f"{c['spec_draft_steps'] / c['steps']:.2f}" if name == "draft" else "-"])
    lines = ["# Speculative decoding: n-gram prompt lookup and a draft model (issue 16)", "",
             f"Command: `{command_line('spec_decode', argv)}`", "", machine_line(machine_info()), "",
             f"Embedded tiny model (6 layers, 256 wide) and its draft (2 layers, 128 wide), greedy, "
             f"{args.max_tokens} new tokens per prompt, prompts from the Python docs (their training text), "
             f"{args.rounds} alternating rounds per engine, totals over the rounds.", "",
             *markdown_table(["batch", "proposer", "k", "tokens/s", "vs off", "acceptance",
                              "accepted per verify row", "tokens per step", "draft steps per step"], rows), ""]
    write_text(f"{RESULTS_DIR}/spec_decode.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
