"""New weights for a serving engine: loaded in place (jaxserve/weight_update.py: what the server's
/update_weights_from_disk and an RL trainer's LLM.load_weights do) against a restart on them: a
new process that loads the weights and warms up, cold or with warm-up's executables already in
the store (compilation_cache_dir), as a restarted server would. The new weights are the
checkpoint's own: the time does not depend on their values.

Seconds per way (a restart's from the process start to the end of warm-up), the median of
--rounds alternating rounds, and the compilations each way made.

  python -m benchmarks.weight_update [--model 100m] [--rounds 3] [--out benchmarks/results/weight_update_cpu.md]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import load_average, markdown_table, model_run_args, model_summary, prepare_model, publish
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.weight_update import checkpoint_tensors, update_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAYS = ("restart, cold", "restart, executables stored", "update from disk", "update from memory")


def start(model_dir: str, store: str | None) -> LLMEngine:
    """The engine `jaxserve serve --model model_dir` builds (float32), warmed up."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", compilation_cache_dir=store))
    engine.warmup()
    return engine


def restart(model_dir: str, store: str | None) -> tuple[float, int]:
    """(seconds from the process start to the end of warm-up, compilations) of a new process."""
    code = ("import json, sys; from benchmarks.weight_update import start; from jaxserve.compilations import "
            "CompileCounter; CompileCounter.install(); start(sys.argv[1], sys.argv[2] or None); "
            "print(json.dumps(CompileCounter.count))")
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, model_dir, store or ""], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    return time.perf_counter() - t, json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_run_args(p)
    args = p.parse_args(argv)
    model_dir = prepare_model(args.model, args.work_dir)
    store = tempfile.mkdtemp(prefix="jaxserve-weight-update-")
    restart(model_dir, store)   # untimed: fills the store
    CompileCounter.install()
    engine = start(model_dir, None)
    seconds, compiles = {w: [] for w in WAYS}, dict.fromkeys(WAYS, 0)

    def update(way: str, weights=None) -> list:
        t, before = time.perf_counter(), CompileCounter.count
        weights = weights or checkpoint_tensors(model_dir)
        update_engine(engine, weights)
        seconds[way].append(time.perf_counter() - t)
        compiles[way] += CompileCounter.count - before
        return weights

    loads = [load_average()]
    for _ in range(args.rounds):
        for way, cache in zip(WAYS, (None, store)):
            s, n = restart(model_dir, cache)
            seconds[way].append(s)
            compiles[way] += n
        update(WAYS[3], update(WAYS[2]))
    loads.append(load_average())

    median = {w: statistics.median(seconds[w]) for w in WAYS}
    rows = [[w, f"{median[w]:.2f} s", ", ".join(f"{s:.2f}" for s in seconds[w]), f"{median[WAYS[0]] / median[w]:.1f}x",
             f"{compiles[w] / args.rounds:.0f}"] for w in WAYS]
    return publish(
        "New weights for a serving engine: in place against a restart", "weight_update", argv, args.out,
        f"Model: {model_summary(model_dir)}, float32, the engine's default buckets "
        f"({len(engine.runner.buckets.warmup_shapes(False))} step shapes). Load average (1 min) before and after: "
        f"{loads[0]:.1f}, {loads[1]:.1f}.", "",
        *markdown_table(["way", "median", "rounds (s)", "faster than a cold restart", "compilations per round"],
                        rows, right_aligned=(1, 3, 4)))


if __name__ == "__main__":
    main()
