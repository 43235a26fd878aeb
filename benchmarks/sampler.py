"""The sampler's top-k / top-p threshold: a radix select (jaxserve/sampling.py) against the
full-vocabulary sort it replaced (kept here as the baseline), in one process.

  * compile seconds of every sampler variant warm-up builds (plain, penalties+bias, mask, all
    three) for real chips, no chip attached: XLA:TPU on a compile-only v6e device (libtpu),
    and XLA:GPU + ptxas on a compile-only H100 (the jax-cuda12-plugin and an H100 target
    description, jaxserve/assets/targets), as `jaxserve check` compiles them;
  * run time on this machine's CPU of batches that take the filter path (temperature 0.8; top_p
    0.9 alone, top_k 50 alone, or both with top_k on half the rows), the two arms alternating, medians.

    python -m benchmarks.sampler [--vocab 128256] [--rows 8] [--targets v6e,h100,cpu] [--cpu-rows 1,8,64]
                                 [--filters top_p,top_k,both]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (RESULTS_DIR, command_line, machine_info, machine_line, markdown_table,
                               write_keeping_notes)
from jaxserve import check, parallel, sampling
from jaxserve.sampling_params import SamplingParams
from jaxserve.step import sampler_args, serving_sample


SELECT = sampling._top_k_top_p_threshold


def sort_threshold(scaled, top_k, top_p, filters=None):
    """The threshold as jaxserve computed it before the radix select: one descending sort of
    each row over the vocabulary, the top-p mass as a cumulative sum in that order."""
    vocab = scaled.shape[1]

    def by_sorting(x, k):
        desc = jnp.sort(x, axis=-1, descending=True)
        in_k = jnp.arange(vocab)[None, :] < k[:, None]
        probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_p = jnp.sum(in_k & (mass_before < top_p[:, None]), axis=-1)
        n = jnp.maximum(jnp.where(top_p < 1.0, n_p, k), 1)
        return jnp.take_along_axis(desc, (n - 1)[:, None], axis=-1)

    return sampling.filtered_threshold(by_sorting, scaled, top_k, top_p, filters)


ARMS = {"sort": sort_threshold, "radix select": SELECT}


def use(arm: str) -> None:
    sampling._top_k_top_p_threshold = ARMS[arm]
    jax.clear_caches()   # the jitted sampler traced with the other arm


def target_devices(target: str):
    if target == "cpu":
        return jax.devices("cpu")[:1]
    return check.target_slice(target if target == "h100" else f"{target}-1").devices[:1]


def compile_seconds(target: str, rows: int, vocab: int) -> dict[str, list[tuple[str, float]]]:
    mesh = parallel.make_mesh({"model": 1}, target_devices(target))
    out = {}
    for arm in ARMS:
        use(arm)
        out[arm] = []
        for name, (logits, md) in sampler_args([rows], vocab, mesh, 8192):
            t = time.perf_counter()
            serving_sample.lower(logits, md, length=rows).compile()
            out[arm].append((name, time.perf_counter() - t))
    return out


# The batches timed: top_p alone (what most clients send), top_k alone, and both (top_k on half the rows).
FILTERS = {"top_p": lambda i: dict(top_p=0.9), "top_k": lambda i: dict(top_k=50),
           "both": lambda i: dict(top_p=0.9, top_k=50 if i % 2 else 0)}


def cpu_run_ms(rows: int, vocab: int, rounds: int, filters: str) -> dict[str, float]:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(rows, vocab)).astype(np.float32) * 3)
    params = [SamplingParams(temperature=0.8, seed=i, **FILTERS[filters](i)) for i in range(rows)]
    md = sampling.SamplingMetadata.build(params, [[0]] * rows, [[]] * rows, list(range(rows)), rows)
    calls = {}
    for arm in ARMS:
        use(arm)
        calls[arm] = jax.jit(sampling.sample.__wrapped__).lower(logits, md).compile()
        calls[arm](logits, md).tokens.block_until_ready()
    times = {arm: [] for arm in ARMS}
    for _ in range(rounds):
        for arm, call in calls.items():
            t = time.perf_counter()
            call(logits, md).tokens.block_until_ready()
            times[arm].append(time.perf_counter() - t)
    return {arm: statistics.median(ts) * 1e3 for arm, ts in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=128256)   # Llama 3's
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--targets", default="v6e,h100,cpu")
    ap.add_argument("--cpu-rows", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--filters", default=",".join(FILTERS), help="the batches timed on the CPU: " + ", ".join(FILTERS))
    ap.add_argument("--out", default=os.path.join(RESULTS_DIR, "sampler_compile.md"))
    args = ap.parse_args(argv)
    lines = ["# Sampler threshold: radix select against sort\n", f"Command: `{command_line('sampler', argv)}`",
             machine_line(machine_info()) + "\n",
             f"## Compile seconds, {args.rows} logit rows, vocabulary {args.vocab}\n"]
    rows = []
    for target in args.targets.split(","):
        seconds = compile_seconds(target, args.rows, args.vocab)
        for (name, sort_s), (_, select_s) in zip(seconds["sort"], seconds["radix select"]):
            rows.append([target, name, f"{sort_s:.1f}", f"{select_s:.1f}", f"{sort_s / select_s:.1f}x"])
            print(*rows[-1], flush=True)
    lines += markdown_table(["target", "variant", "sort s", "radix select s", "ratio"], rows, (2, 3, 4))
    lines += [f"\n## CPU run time of a filtered batch (ms, median of {args.rounds}, alternating)\n"]
    rows = []
    for vocab in sorted({32000, args.vocab}):
        for r in map(int, args.cpu_rows.split(",")):
            for filters in args.filters.split(","):
                ms = cpu_run_ms(r, vocab, args.rounds, filters)
                sort_ms, select_ms = ms["sort"], ms["radix select"]
                rows.append([vocab, r, filters, f"{sort_ms:.2f}", f"{select_ms:.2f}", f"{sort_ms / select_ms:.2f}x"])
                print(*rows[-1], flush=True)
    lines += markdown_table(["vocab", "rows", "filters", "sort ms", "radix select ms", "ratio"], rows, (0, 1, 3, 4, 5))
    write_keeping_notes(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
