"""Speculative decoding, n-gram prompt lookup and a draft model, against none, side by side in
one process, up to saturation (batch = max_num_seqs).

(a) The embedded tiny model (its draft: jaxserve/assets/tiny/draft), greedy, on Python-docs
    prompts (its training text): no speculation, n-gram lookup and the draft, k = 2, 4, 6.
(b) The random 100M model (benchmarks/common.py) with n-gram lookup, on prompts whose greedy
    continuation repeats their own text: each is a random seed and the model's own greedy
    continuation of it (a random model's greedy output falls into loops), so what follows goes
    on repeating the prompt. "repeats": the share of the output tokens that n-gram lookup would
    have proposed first (ngram.propose with k = 1), over the run without speculation.

Every speculating engine runs in two modes: "throttled", the throttle's default rule
(jaxserve/spec_decode/throttle.py), and "always" (disable_by_batch_size = max_num_seqs: every
step speculates, as before the throttle). For each batch size every engine and mode runs once
untimed after warm-up (the throttle learns the step costs), then in alternating timed rounds. Reported:
output tokens/s, how much faster than without, the acceptance rate (accepted / proposed),
accepted tokens per verify row, tokens and milliseconds per engine step (the step costs: a
verify step costs less than k + 1 plain ones only while the step is limited by memory),
draft-model steps per engine step, the share of steps run without speculation (the
throttle's), and "speculates up to": the largest batch of 128-token contexts the rule
speculates for at the engine's mean acceptance after the run, and whether the greedy outputs
equal those without speculation.

    python -m benchmarks.spec_decode [--rounds 1] [--max-tokens 128] [--batches 1 4 16 64]
        [--ks 2 4 6] [--modes throttled always] [--proposers ngram draft] [--b-batches 1 4 16 64]
        [--b-ks 2 4 6] [--work-dir /tmp/jaxserve_bench]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import (RESULTS_DIR, command_line, load_average, machine_info, machine_line, markdown_table,
                               model_summary, prepare_model, write_keeping_notes)
from jaxserve import LLM, SamplingParams
from jaxserve.compilations import CompileCounter
from jaxserve.spec_decode import ngram, throttle

PROMPTS = ["The for statement is used to", "def square(x):\n    return x * x\n\ndef cube(x):\n",
           "A list is a sequence. A list is", "import os\nimport sys\nimport", "The with statement",
           "Exceptions are raised when", "class Point:\n    def __init__(self, x, y):\n", "The while loop"]
# The engine defaults (max_num_batched_tokens holds 64 verify rows of 1 + 6 tokens) but the context length.
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=512, prefill_chunk_size=256, max_prefill_seqs=4,
              max_model_len=512)
NGRAM = {"method": "ngram", "ngram_min": 1, "ngram_max": 3}
DRAFT = {"method": "draft"}
# disable_by_batch_size: the throttle's default rule, or speculating at every batch size
MODES = {"throttled": None, "always": ENGINE["max_num_seqs"]}
HEADER = ["batch", "proposer", "k", "mode", "tokens/s", "vs off", "acceptance", "accepted per verify row",
          "tokens per step", "ms per step", "draft steps per step", "steps without speculation", "speculates up to",
          "same outputs as off"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(llm: LLM, prompts: list, max_tokens: int) -> tuple[float, dict, list[list[int]]]:
    """Seconds for the batch, the engine's counters' increase, the output token ids."""
    stats = llm.llm_engine.stats
    before = dict(stats)
    start = time.perf_counter()
    outs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return time.perf_counter() - start, {k: stats[k] - before[k] for k in stats}, [o.outputs[0].token_ids for o in outs]


def build(engine_cfg: dict, proposers: list[tuple[str, dict]], ks: list[int]) -> dict:
    """The LLMs, warmed up as a server is (every shape the throttle may pick is built): none,
    then each proposer at each k."""
    engines = {("off", 0): LLM(**engine_cfg)}
    for name, spec in proposers:
        engines.update({(name, k): LLM(**engine_cfg, speculative={**spec, "num_tokens": k}) for k in ks})
    for llm in engines.values():
        llm.llm_engine.warmup()
    return engines


def run_as(engines: dict, config: tuple[str, int, str], prompts: list, max_tokens: int):
    """`run` with engines[proposer, k] in `mode` (its disable_by_batch_size)."""
    name, k, mode = config
    if k:
        engines[name, k].llm_engine.ecfg.speculative.disable_by_batch_size = MODES[mode]
    return run(engines[name, k], prompts, max_tokens)


def speculates_up_to(llm: LLM, context: int = 128) -> int:
    engine = llm.llm_engine
    engine.ecfg.speculative.disable_by_batch_size = None   # the rule's answer
    return max((b for b in range(1, engine.ecfg.max_num_seqs + 1) if engine.throttle.speculates([context] * b, False)),
               default=0)


def measure(engines: dict, modes: list[str], prompts: list, batches: list[int], rounds: int,
            max_tokens: int) -> tuple[list, dict, int]:
    """The table's rows, the outputs without speculation per batch size, and the compilations
    during the timed rounds (after an untimed one)."""
    configs = [("off", 0, "-")] + [(name, k, mode) for name, k in engines if k for mode in modes]
    rows, plain_outputs, compiles = [], {}, 0
    for batch in batches:
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for config in configs:   # untimed: each engine once
            run_as(engines, config, batch_prompts, max_tokens)
        before = CompileCounter.count
        totals = {config: [0.0, {}, None] for config in configs}
        for _ in range(rounds):
            for config in configs:
                seconds, counts, outputs = run_as(engines, config, batch_prompts, max_tokens)
                totals[config][0] += seconds
                totals[config][1] = {c: totals[config][1].get(c, 0) + v for c, v in counts.items()}
                totals[config][2] = outputs
        compiles += CompileCounter.count - before
        plain_outputs[batch] = totals[configs[0]][2]
        base = totals[configs[0]][1]["generation_tokens"] / totals[configs[0]][0]
        saturation = " (saturation)" if batch == ENGINE["max_num_seqs"] else ""
        for (name, k, mode), (seconds, c, outputs) in totals.items():
            rate = c["generation_tokens"] / seconds
            verified = c["spec_verify_rows"]
            rows.append([f"{batch}{saturation}", name, k or "-", mode, f"{rate:.1f}", f"{rate / base:.2f}x",
                         f"{c['spec_accepted_tokens'] / c['spec_proposed_tokens']:.2f}" if verified else "-",
                         f"{c['spec_accepted_tokens'] / verified:.2f}" if verified else "-",
                         f"{c['generation_tokens'] / c['steps']:.2f}", f"{1e3 * seconds / c['steps']:.1f}",
                         f"{c['spec_draft_steps'] / c['steps']:.2f}" if name == "draft" else "-",
                         f"{c['spec_off_steps'] / c['steps']:.0%}" if k else "-",
                         speculates_up_to(engines[name, k]) if mode == "throttled" else "-",
                         "yes" if outputs == plain_outputs[batch] else "NO"])
        print(*markdown_table(HEADER, rows[-len(totals):]), sep="\n", flush=True)   # progress
    return rows, plain_outputs, compiles


def repeating_prompts(llm: LLM, count: int, seed_tokens: int = 16, loop_tokens: int = 112) -> list[dict]:
    """Random seeds each followed by the model's greedy continuation of it."""
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.model_cfg.vocab_size
    seeds = [rng.integers(3, vocab, seed_tokens).tolist() for _ in range(count)]
    outs = llm.generate([{"prompt_token_ids": s} for s in seeds], greedy(loop_tokens), use_tqdm=False)
    return [{"prompt_token_ids": s + o.outputs[0].token_ids} for s, o in zip(seeds, outs)]


def repeat_share(prompts: list[dict], outputs: list[list[int]]) -> float:
    """The share of output tokens that n-gram lookup (NGRAM's n, k = 1) proposes from the tokens before."""
    hits = total = 0
    for prompt, out in zip(prompts, outputs):
        tokens = prompt["prompt_token_ids"] + out
        start = len(prompt["prompt_token_ids"])
        for i in range(start, len(tokens)):
            hits += ngram.propose(tokens[:i], 1, NGRAM["ngram_min"], NGRAM["ngram_max"]) == [tokens[i]]
        total += len(tokens) - start
    return hits / total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="*", default=[1, 4, 16, 64], help="workload (a); none: skip it")
    p.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--proposers", nargs="+", default=["ngram", "draft"], choices=["ngram", "draft"])
    p.add_argument("--b-batches", type=int, nargs="*", default=[1, 4, 16, 64], help="workload (b); none: skip it")
    p.add_argument("--b-ks", type=int, nargs="+", default=[2, 4, 6])
    p.add_argument("--work-dir", default="/tmp/jaxserve_bench", help="where the 100m model is built and the "
                   "executables are stored")
    p.add_argument("--out", default=f"{RESULTS_DIR}/spec_decode.md")
    args = p.parse_args(argv)
    machine = machine_info()

    proposers = {"ngram": NGRAM, "draft": DRAFT}
    cache_dir = os.path.join(args.work_dir, "xla")   # warm-up's executables, kept between runs
    lines_a, lines_b, compiles = [], [], 0
    if args.batches:
        tiny = build(dict(ENGINE, kv_cache_mb=64, compilation_cache_dir=cache_dir),
                     [(name, proposers[name]) for name in args.proposers], args.ks)
        rows_a, _, compiles = measure(tiny, args.modes, PROMPTS, args.batches, args.rounds, args.max_tokens)
        del tiny
        lines_a = ["## (a) Embedded tiny model and its draft, Python-docs prompts", "",
                   "Tiny model: 6 layers, 256 wide; draft: 2 layers, 128 wide; prompts from the Python docs (their "
                   "training text).", "", *markdown_table(HEADER, rows_a), ""]
    if args.b_batches:
        model_dir = prepare_model("100m", args.work_dir)
        engines = build(dict(ENGINE, model=model_dir, kv_cache_mb=512, compilation_cache_dir=cache_dir),
                        [("ngram", NGRAM)], args.b_ks)
        prompts = repeating_prompts(engines["off", 0], max(args.b_batches))
        rows_b, plain, more = measure(engines, args.modes, prompts, args.b_batches, args.rounds, args.max_tokens)
        compiles += more
        lines_b = ["## (b) 100M model, n-gram lookup, prompts whose continuation repeats them", "",
                   f"Model: {model_summary(model_dir)}, float32. {max(args.b_batches)} prompts of 16 random tokens "
                   f"and the model's 112-token greedy continuation of them; {args.max_tokens} new tokens each. "
                   f"Repeats: {repeat_share(prompts, plain[max(args.b_batches)]):.0%} of the output tokens are "
                   f"what n-gram lookup (n = {NGRAM['ngram_max']} down to {NGRAM['ngram_min']}) proposes first.", "",
                   *markdown_table(HEADER, rows_b), ""]
    peaks = throttle._peaks()
    lines = ["# Speculative decoding: n-gram prompt lookup and a draft model (issue 16)", "",
             f"Command: `{command_line('spec_decode', argv)}`", "",
             f"{machine_line(machine)}; load average (1 min) at end {load_average():.1f}", "",
             f"Greedy, {args.max_tokens} new tokens per prompt, {args.rounds} alternating round(s) per engine, totals "
             f"over the rounds; engines: max_num_seqs {ENGINE['max_num_seqs']} (the saturation row), token budget "
             f"{ENGINE['max_num_batched_tokens']}; modes: throttled (the throttle's default rule, "
             f"jaxserve/spec_decode/throttle.py; its peaks: {peaks.source}, {peaks.flops / 1e9:.0f} GFLOP/s, "
             f"{peaks.bandwidth / 1e9:.1f} GB/s), always (every step speculates). For each batch size every engine "
             f"and mode runs once untimed after warm-up, then the timed rounds: {compiles} "
             f"compilations during them.", "",
             *lines_a, *lines_b]
    write_keeping_notes(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
