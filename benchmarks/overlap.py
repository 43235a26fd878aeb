"""The overlapped host loop: how much of the wall time the device sits idle waiting for the host.

For batch sizes B (default 1, 16, 64) on the 100M model: B requests (seeded random prompts,
greedy, ignore_eos, fixed output length) run to completion with the engine's overlap off and on,
alternating rounds in one process (the same engine, `engine.overlap` switched). Per step the
benchmark records when its computations were launched (runner.replay returned) and, from a
watcher thread blocked on the step's sampled tokens, when they were done. Step k keeps the device
busy over [max(launched_k, done_{k-1}), done_k]; everything else is idle:
  * idle share = 1 - busy time / wall time (first launch to last done);
  * host ms on the critical path per step = mean of max(0, launched_k - done_{k-1}): how long the
    device waited for the host between two steps.
Outputs of the two modes are compared token for token. Writes benchmarks/results/overlap.md.
With --regex every request is constrained to it (structured output; the model's tokenizer must
spell it: --model tiny): the overlapped loop then launches each step's sampler on its own, after
the previous step's collection (a launch of its own in the timeline, part of its step in the figures).

  python -m benchmarks.overlap [--batches 1,16,64] [--output-len 32] [--rounds 2] [--regex RE]
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
import time

import jax

from benchmarks.common import (RESULTS_DIR, command_line, load_average, machine_info, machine_line, make_workload,
                               markdown_table, model_summary, prepare_model, write_keeping_notes)
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutput

RESULTS = os.path.join(RESULTS_DIR, "overlap.md")


class Timeline:
    """Wraps one engine's runner.replay (instance attribute) to timestamp each step's launch, and
    a watcher thread that timestamps when its last computation is done."""

    def __init__(self, engine: LLMEngine):
        self.runner = engine.runner
        self.replay = self.runner.replay
        self.runner.replay = self._replay
        self.launched: list[float] = []
        self.done: list[float] = []
        self._pending: queue.Queue = queue.Queue()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _replay(self, message):
        sampled = self.replay(message)
        self.launched.append(time.perf_counter())
        # A model whose sampler comes later: its logits (the KV cache is donated to the next step).
        unsampled = self.runner._unsampled_logits
        self._pending.put([s for s in sampled if s is not None]
                          or (self.runner.kv_cache if unsampled is None else unsampled))
        return sampled

    def _watch(self) -> None:
        while (arrays := self._pending.get()) is not None:
            jax.block_until_ready(arrays)
            self.done.append(time.perf_counter())

    def close(self, steps: int) -> dict:
        """The figures over the engine's `steps` (a deferred sampler's replay is part of its step)."""
        self._pending.put(None)
        self._watcher.join()
        self.runner.replay = self.replay
        busy, waits, last_done = 0.0, [], None
        for launched, done in zip(self.launched, self.done):
            start = launched if last_done is None else max(launched, last_done)
            if last_done is not None:
                waits.append(max(0.0, launched - last_done))
            busy += done - start
            last_done = done
        wall = self.done[-1] - self.launched[0]
        return {"steps": steps, "wall_s": wall, "idle": 1 - busy / wall,
                "host_ms_critical": 1e3 * sum(waits) / max(steps - 1, 1), "device_ms_per_step": 1e3 * busy / steps}


def run(engine: LLMEngine, requests, overlap: bool, regex: str | None = None) -> tuple[dict, list[list[int]]]:
    engine.overlap = overlap
    constraint = StructuredOutput("regex", regex) if regex else None
    ids = [engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                 ignore_eos=True, structured_output=constraint))
           for r in requests]
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    timeline, steps = Timeline(engine), engine.stats["steps"]
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    stats = timeline.close(engine.stats["steps"] - steps)
    stats["tokens_per_s"] = sum(map(len, outputs.values())) / seconds
    return stats, [outputs[i] for i in ids]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="100m", help="tiny, 100m or a model directory")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of overlap off / on (best counts)")
    p.add_argument("--modes", default="off,on", help="overlap off, on, or both")
    p.add_argument("--work-dir", default="/tmp/jaxserve_bench", help="where the 100m model is built")
    p.add_argument("--regex", help="constrain every request to this regex (structured output)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    # The watcher thread must get the GIL soon after a step is done for its timestamp to be right.
    sys.setswitchinterval(5e-4)
    machine = machine_info()
    model_dir = prepare_model(args.model, args.work_dir)
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m == "on" for m in args.modes.split(",")]
    max_len = args.prompt_len + args.output_len
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", max_model_len=max_len, page_size=16,
                                    enable_prefix_caching=False, max_num_seqs=max(batches),
                                    num_pages=max(batches) * -(-max_len // 16), max_num_batched_tokens=512,
                                    prefill_chunk_size=512))
    engine.warmup()
    rows = []
    for b in batches:
        requests = make_workload(b, (args.prompt_len, args.prompt_len), (args.output_len, args.output_len),
                                 engine.model_cfg.vocab_size, seed=b)
        best, outputs = {}, {}
        for _ in range(args.rounds):
            for overlap in modes:
                stats, outputs[overlap] = run(engine, requests, overlap, args.regex)
                print(f"batch {b} overlap {'on' if overlap else 'off'}: {stats}", flush=True)
                if overlap not in best or stats["tokens_per_s"] > best[overlap]["tokens_per_s"]:
                    best[overlap] = stats
        same = len(set(map(str, outputs.values()))) == 1
        for overlap, s in best.items():
            rows.append([b, "on" if overlap else "off", s["steps"], f"{s['wall_s']:.2f}", f"{s['tokens_per_s']:.1f}",
                         f"{s['device_ms_per_step']:.1f}", f"{s['host_ms_critical']:.2f}", f"{s['idle']:.1%}",
                         "yes" if same else "NO"])
    machine["load average (1 min) at end"] = f"{load_average():.1f}"
    lines = ["# Overlapped host loop: device idle share", "",
             f"Command: `{command_line('overlap', argv)}`  ", machine_line(machine) + " (2-core CPU dev box, shared)", "",
             f"Model: {args.model} ({model_summary(model_dir)}), float32. Per batch size B: B requests of "
             f"{args.prompt_len} random prompt tokens, {args.output_len} greedy output tokens (ignore_eos), all "
             f"submitted at once{f', constrained to the regex `{args.regex}`' if args.regex else ''}; best of "
             f"{args.rounds} alternating rounds (overlap off, on) by tokens/s.", "",
             "Idle share: the share of wall time (first launch to last step done) in which no step's "
             "computations were executing; host ms on the critical path: per step, how long the device "
             "waited for the host to launch it (see the module docstring of benchmarks/overlap.py).", ""]
    lines += markdown_table(["batch", "overlap", "steps", "wall s", "tokens/s", "device ms per step",
                             "host ms on critical path per step", "idle share", "same outputs"], rows)
    write_keeping_notes(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
