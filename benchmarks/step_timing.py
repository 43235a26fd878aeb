"""Step speed of the embedded tiny model with configs/tiny-cpu.yaml, after warm-up: decode steps
with 16 and with 1 running sequence(s), a 128-token prompt's prefill, and a burst of 16 short
prompts to their first tokens (the median of each, ms).
Uses only the engine's public API, so it times any jaxserve tree: run it once per tree, in
alternating order, for a side-by-side comparison (benchmarks/results/startup.md).

  PYTHONPATH=<tree> python benchmarks/step_timing.py [--config configs/tiny-cpu.yaml] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jaxserve
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams


def decode_ms(engine: LLMEngine, rows: int, steps: int) -> float:
    """Median engine.step() time once `rows` sequences are all decoding."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(rows):
        engine.add_request([1 + (7 * i + j) % 4000 for j in range(8)], params)
    while engine.scheduler.waiting or any(not s.output_token_ids for s in engine.scheduler.running):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    while engine.has_unfinished():
        engine.step()
    return 1e3 * statistics.median(times)


def first_tokens_ms(engine: LLMEngine, rounds: int, prompts: int, prompt_len: int) -> float:
    """Median time until `prompts` prompts of `prompt_len` tokens, submitted together, all have
    their first token."""
    times = []
    for r in range(rounds):
        for i in range(prompts):
            engine.add_request([1 + (11 * r + 5 * i + j) % 4000 for j in range(prompt_len)],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs", "tiny-cpu.yaml"))
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig.from_yaml(args.config))
    engine.warmup()
    engine.step()
    print(json.dumps({"tree": os.path.dirname(os.path.dirname(jaxserve.__file__)),
                      "decode16_ms": round(decode_ms(engine, 16, args.steps), 3),
                      "decode1_ms": round(decode_ms(engine, 1, args.steps), 3),
                      "prefill128_ms": round(first_tokens_ms(engine, 20, 1, 128), 3),
                      "burst16x24_ms": round(first_tokens_ms(engine, 10, 16, 24), 3),
                      "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
