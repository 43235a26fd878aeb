"""Structured output's cost per engine step: a batch of 16 where every row follows a JSON schema,
against the same batch unconstrained, side by side in one process (alternating rounds).

Per model, each mode runs 16 requests of `--max-tokens` tokens (the schema asks for a long array,
so no row ends early; unconstrained rows ignore eos) and times the engine steps that decode all
16 rows (no prefill in them). Modes: free text; free text with a logit bias (the sampler variant
with penalties and a bias); JSON schema in the overlapped loop (a constrained step's model
launched before the previous step is collected, its sampler after: the masks are filled while the
model runs; the mask-only sampler variant); the same with a logit bias (the variant with all
three, which every constrained batch took before the mask-only one); JSON schema in the
synchronous loop (`engine.overlap` off: each step collected before the next is planned, the mask
filled before the step is launched, as constrained steps ran before the overlap). Also timed: the
host's mask fill (`token_masks`, inside the step's time), per step.

Models: `tiny` (the embedded model, 4,096-piece tokenizer: the shortest step, the worst case for
a per-step overhead) and `100m` (benchmarks/common.py's random ~100M Llama with a 32,000-piece
BPE tokenizer: the word-level tokenizer it is built with has no token that writes JSON, so its
weights are paired with grammar_libraries' Llama-style BPE, the same ids 0-2 for unk/bos/eos).

    python -m benchmarks.structured_output [--models tiny,100m] [--rounds 3] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

import jaxserve.sampling
from benchmarks.common import RESULTS_DIR, WORK_DIR, command_line, load_average, machine_info, machine_line, \
    markdown_table, model_summary, prepare_model, write_keeping_notes
from benchmarks.grammar_libraries import llama_style_tokenizer
from jaxserve import LLM, SamplingParams
from jaxserve.structured import StructuredOutput

ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_size=128, max_prefill_seqs=4,
              max_model_len=256, kv_cache_mb=64)
BATCH = 16
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 60, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "kind": {"enum": ["tool", "part", "kit"]}},
    "required": ["name", "qty", "kind"]}}}, "required": ["items"]}
JSON = {"structured_output": StructuredOutput.json_schema(SCHEMA)}
# mode: (sampling settings, engine.overlap)
BIAS = {"logit_bias": {7: 0.5}}
MODES = {"free": ({}, True), "free + logit bias": (BIAS, True), "JSON schema": (JSON, True),
         "JSON schema + logit bias": ({**JSON, **BIAS}, True), "JSON schema, synchronous loop": (JSON, False)}


class FillTimer:
    """Wraps the sampler metadata's mask fill to add up its time."""

    def __init__(self):
        self.seconds, self._fill = 0.0, jaxserve.sampling.token_masks
        jaxserve.sampling.token_masks = self

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._fill(*args)
        finally:
            self.seconds += time.perf_counter() - start


def run(llm: LLM, params: SamplingParams, fill: FillTimer, overlap: bool = True) -> tuple[list[float], float]:
    """Times of the steps that decode the whole batch, and the mask fill's seconds in them."""
    engine = llm.llm_engine
    engine.overlap = overlap
    for i in range(BATCH):
        engine.add_request(engine.tokenizer.encode(f"Inventory list {i} as JSON:"),
                           dataclasses.replace(params, seed=i))
    times, filled = [], 0.0
    while engine.has_unfinished():
        before, start = fill.seconds, time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        rows = engine.last_schedule.scheduled
        if len(rows) == BATCH and not any(s.is_prefill_row for s in rows):
            times.append(seconds)
            filled += fill.seconds - before
    return times, filled


def model_dir(name: str, work_dir: str) -> str:
    """The model directory for `name`: 100m's weights beside a 32,000-piece BPE tokenizer (built once)."""
    if name != "100m":
        return prepare_model(name, work_dir)
    weights, out = prepare_model(name, work_dir), os.path.join(work_dir, "llama-100m-bpe")
    os.makedirs(out, exist_ok=True)
    for f in ("config.json", "model.safetensors", "tokenizer_config.json"):
        if not os.path.exists(os.path.join(out, f)):
            os.symlink(os.path.join(weights, f), os.path.join(out, f))
    llama_style_tokenizer(out)
    return out


def measure(name: str, directory: str, args, fill: FillTimer) -> list[list]:
    """The table's rows for one model: each temperature's modes in alternating rounds."""
    # executables stored under the work dir: a rerun of the same sources loads instead of compiling
    llm = LLM(model=directory, **ENGINE, compilation_cache_dir=os.path.join(args.work_dir, "executables"))
    llm.llm_engine.warmup()
    rows = []
    for temperature in (0.0, 0.8):
        base = dict(max_tokens=args.max_tokens, temperature=temperature, ignore_eos=True)
        times = {mode: [] for mode in MODES}
        fills = dict.fromkeys(MODES, 0.0)
        run(llm, SamplingParams(**base), fill)   # a round first to settle caches and allocations
        for _ in range(args.rounds):
            for mode, (extra, overlap) in MODES.items():
                t, f = run(llm, SamplingParams(**base, **extra), fill, overlap)
                times[mode] += t
                fills[mode] += f
        free = np.mean(times["free"])
        for mode in MODES:
            mean = np.mean(times[mode])
            rows.append([name, temperature, mode, len(times[mode]), f"{mean * 1e3:.2f}",
                         f"{np.median(times[mode]) * 1e3:.2f}", f"{fills[mode] / len(times[mode]) * 1e3:.3f}",
                         f"{(mean / free - 1) * 100:+.1f}%"])
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", default="tiny", help="comma-separated: tiny, 100m or model directories")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--work-dir", default=WORK_DIR, help="where the 100m model is built and executables stored")
    p.add_argument("--out", default=f"{RESULTS_DIR}/structured_output.md")
    args = p.parse_args(argv)
    fill = FillTimer()
    rows, models = [], []
    for name in args.models.split(","):
        directory = model_dir(name, args.work_dir)
        models.append(f"{name}: {model_summary(directory)}")
        rows += measure(name, directory, args, fill)
    lines = ["# Structured output: per-step cost with every row of a batch of 16 constrained", "",
             f"Command: `{command_line('structured_output', argv)}`", "", machine_line(machine_info()), "",
             f"Models: {'; '.join(models)}. {BATCH} requests of {args.max_tokens} tokens per mode, "
             f"{args.rounds} alternating rounds; steps that decode all {BATCH} rows, whole engine step (host "
             "scheduling, mask fill, device step and sampler, detokenizing).", "",
             *markdown_table(["model", "temperature", "mode", "steps", "mean ms", "p50 ms", "mask fill ms/step",
                              "vs free"], rows), "", f"Load average (1 min) at the end: {load_average():.1f}.", ""]
    write_keeping_notes(args.out, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
