"""Sleep mode (jaxserve/sleep_mode.py), as an RL trainer colocated with the engine uses it between
rollouts: `LLM.sleep` gives the device memory back, `LLM.wake_up` takes it again.

Per level, the median of --rounds rounds of: a rollout (a fixed greedy workload), sleep, wake up
(level 2: the weights, then `load_weights` with the full set from host memory, as the trainer
hands them over, then the KV cache), and the rollout again. Device bytes are those of every live
JAX array (the largest device's), before sleep, asleep and awake again; compilations are those
of the wake-ups, the load and the rollout after them (the first rollout, untimed, compiled its
steps); the tokens after each wake are compared with the first rollout's.

  python -m benchmarks.sleep_mode [--model 100m] [--rounds 3] [--out benchmarks/results/sleep_mode_cpu.md]
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax

from benchmarks.common import (load_average, make_workload, markdown_table, model_run_args, model_summary, prepare_model,
                               publish)
from jaxserve import LLM, SamplingParams
from jaxserve.compilations import CompileCounter
from jaxserve.sleep_mode import live_device_bytes
from jaxserve.weight_update import checkpoint_tensors


def device_mib() -> float:
    return max(live_device_bytes().values(), default=0) / 2**20


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_run_args(p)
    p.add_argument("--num-prompts", type=int, default=8)
    args = p.parse_args(argv)
    model_dir = prepare_model(args.model, args.work_dir)
    llm = LLM(model=model_dir, dtype="float32", compilation_cache_dir=None)
    engine = llm.llm_engine
    workload = make_workload(args.num_prompts, (64, 64), (32, 32), engine.model_cfg.vocab_size)
    prompts = [r.prompt_token_ids for r in workload]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def rollout() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    want = rollout()   # untimed: compiles the steps
    weights = checkpoint_tensors(model_dir)   # the trainer's copy, in host memory
    loads = [load_average()]
    rows = []
    for level in (1, 2):
        times = {k: [] for k in ("sleep", "wake_up", "load_weights")}
        mib, compiles, equal = [], 0, True
        for _ in range(args.rounds):
            before = device_mib()
            times["sleep"].append(timed(lambda: llm.sleep(level)))
            asleep, n = device_mib(), CompileCounter.count
            if level == 1:
                times["wake_up"].append(timed(llm.wake_up))
            else:   # the trainer's order: weights, its weights into them, then the KV cache
                wake = timed(lambda: llm.wake_up(tags=["weights"]))
                times["load_weights"].append(timed(lambda: llm.load_weights(weights)))
                times["wake_up"].append(wake + timed(lambda: llm.wake_up(tags=["kv_cache"])))
            mib.append((before, asleep, device_mib()))
            equal &= rollout() == want
            compiles += CompileCounter.count - n
        median = {k: f"{statistics.median(v):.3f} s" if v else "-" for k, v in times.items()}
        before, asleep, awake = mib[-1]
        rows.append([level, median["sleep"], median["wake_up"], median["load_weights"], f"{before:.1f}",
                     f"{asleep:.1f}", f"{awake:.1f}", compiles, "yes" if equal else "NO"])
    loads.append(load_average())
    r = engine.runner
    params = sum(x.nbytes for x in jax.tree.leaves(r.params)) / 2**20
    return publish(
        "Sleep mode: the device memory given back between rollouts", "sleep_mode", argv, args.out,
        f"Model: {model_summary(model_dir)}, float32 ({params:.1f} MiB of weights), KV pool of {r.num_pages} pages "
        f"({r.kv_cache.nbytes / 2**20:.1f} MiB). Rollout: {args.num_prompts} prompts of 64 seeded random ids, 32 "
        f"greedy tokens each. {args.rounds} rounds per level; load average (1 min) before and after: "
        f"{loads[0]:.1f}, {loads[1]:.1f}.", "",
        *markdown_table(["level", "sleep", "wake_up", "load_weights (level 2)", "device MiB before", "asleep",
                         "awake", "compilations (wake, load, rollout)", "tokens as before"],
                        rows, right_aligned=(1, 2, 3, 4, 5, 6, 7)))


if __name__ == "__main__":
    main()
