"""Shared by the benchmarks: the models they run (the embedded tiny model, a random ~100M Llama),
seeded random-token workloads, the machine's description, latency percentiles, timed engine steps,
and the writing of reports (markdown tables, JSON, PNG plots, hand-written notes kept).

  100m: hidden 768, 12 layers, 12 heads / 4 KV heads, ffn 2048, vocab 32000, tied embeddings
        -> 100.1M parameters, float32, seeded random weights written with save_pretrained.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time

import numpy as np

from jaxserve.config import ModelConfig

LLAMA_100M = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  initializer_range=0.02)
MODEL_NAMES = ("tiny", "100m")
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WORK_DIR = os.path.join(tempfile.gettempdir(), "jaxserve-bench")   # where the 100m model is built
NOTES_MARKER = "<!-- notes below are written by hand and kept when this file is regenerated -->"


@dataclasses.dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclasses.dataclass
class Run:
    """One timed pass of a system over a workload's requests."""
    system: str
    requests: int
    output_tokens: int
    seconds: float
    outputs: list[list[int]]
    profile: object = None   # offline_throughput.StepProfile of an engine run
    rounds: list[float] = dataclasses.field(default_factory=list)   # tokens/s of each repeat

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def check_lengths(outputs: list[list[int]], requests: list[Request]) -> None:
    bad = [i for i, (o, r) in enumerate(zip(outputs, requests)) if len(o) != r.max_tokens]
    if bad:
        raise RuntimeError(f"requests {bad[:5]} did not get their max_tokens output tokens")


def make_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab_size: int, seed: int = 0) -> list[Request]:
    """Prompts of seeded random token ids (ids 0-2 left out: unk/bos/eos in both models) with
    input and output lengths drawn uniformly from the inclusive ranges."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_range[0], input_range[1] + 1, num_prompts)
    outs = rng.integers(output_range[0], output_range[1] + 1, num_prompts)
    return [Request(rng.integers(3, vocab_size, n).tolist(), int(m)) for n, m in zip(ins, outs)]


def workload_text(args) -> str:
    """The workload of workload_args' arguments, in words, as the results files give it."""
    return (f"{args.num_prompts} prompts of seeded random ids, input {args.min_input}-{args.max_input}, output "
            f"{args.min_output}-{args.max_output} tokens (ignore_eos), greedy, all submitted at once; "
            f"max_num_seqs {args.max_num_seqs}")


def workload_args(p: argparse.ArgumentParser, num_prompts: int = 256, inputs=(16, 512), outputs=(16, 256)) -> None:
    """The workload's and the engine's arguments (engine_config, make_workload), with these defaults."""
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--min-input", type=int, default=inputs[0])
    p.add_argument("--max-input", type=int, default=inputs[1])
    p.add_argument("--min-output", type=int, default=outputs[0])
    p.add_argument("--max-output", type=int, default=outputs[1])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--prefill-chunk-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", default="/tmp/jaxserve_bench", help="where the 100m model is built")


def model_run_args(p: argparse.ArgumentParser) -> None:
    """The arguments of a benchmark on one model in rounds: --model, --rounds, --work-dir, --out."""
    p.add_argument("--model", default="100m", help="tiny, 100m or a model directory")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", default=WORK_DIR)
    p.add_argument("--out", default=None, help="markdown file for the table (notes below the marker kept)")


def prepare_model(name: str, work_dir: str) -> str:
    """The model directory of `name` (HF format): 'tiny', '100m' (built once under work_dir) or the
    path of a Hugging Face model directory."""
    from jaxserve.engine import TINY_MODEL_DIR   # not at import: serve_bench (the CLI) needs no JAX

    if os.path.isdir(name):
        return name
    if name == "tiny":
        return TINY_MODEL_DIR
    if name != "100m":
        raise ValueError(f"unknown model {name!r}; choose from {MODEL_NAMES} or a model directory")
    out_dir = os.path.join(work_dir, "llama-100m")
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        import torch
        import transformers as tf

        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_100M))
        model.save_pretrained(out_dir)
        save_word_tokenizer(out_dir, LLAMA_100M["vocab_size"])
    return out_dir


def save_word_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer.json covering every id of a random model: id i is the word `w{i}`,
    0-2 are <unk>, <s>, </s> (the engine detokenizes whatever ids the model samples)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials), vocab_size)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
                   "eos_token": "</s>", "pad_token": "<unk>"}, f)


def load_hf_model(model_dir: str):
    """The same weights in transformers, float32, eval mode."""
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def model_summary(model_dir: str) -> str:
    c = ModelConfig.from_pretrained(model_dir)
    return (f"{c.num_params:,} parameters: hidden {c.hidden_size}, {c.num_layers} layers, "
            f"{c.num_heads}/{c.num_kv_heads} heads, ffn {c.intermediate_size}, vocab {c.vocab_size}")


def machine_info() -> dict[str, str]:
    """What the figures were measured on."""
    import jax
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    devices = jax.devices()
    accel = "none" if devices[0].platform == "cpu" else f"{len(devices)} x {devices[0].device_kind}"
    return {"cpu": f"{cpu}, {os.cpu_count()} cores", "accelerator": accel,
            "load average (1 min) at start": f"{load_average():.1f}",
            "python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def load_average() -> float:
    """The 1-minute load average: the machine is shared, and a busy neighbour slows a run."""
    return os.getloadavg()[0]


def measured_peaks():
    """This device's roofline.Peaks: the datasheet's, or on CPU measured over 1 GiB and a 2048^2 matmul."""
    from jaxserve import roofline

    return roofline.device_peaks(measure_bytes=1 << 30, matmul_n=2048)


def timed_step(engine) -> tuple[list, float, list[tuple[int, int, bool]]]:
    """One engine step: its outputs, its wall time in seconds and its roofline rows."""
    from jaxserve import roofline

    start = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - start
    return outputs, seconds, roofline.schedule_rows(engine.last_schedule)


def percentiles(values, scale: float = 1e3) -> dict:
    """Mean, p50, p90 and p99 of `values` x `scale` (seconds -> ms by default); None when empty."""
    if not len(values):
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    v = np.asarray(values) * scale
    return {"mean": float(v.mean()), "p50": float(np.percentile(v, 50)), "p90": float(np.percentile(v, 90)),
            "p99": float(np.percentile(v, 99))}


def command_line(module: str, argv: list[str] | None) -> str:
    """How the benchmark was run: `python -m benchmarks.<module>` and its arguments."""
    return " ".join([f"python -m benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def report_header(command: str, args) -> dict:
    """What every JSON report starts with: the date, the command, its arguments, the machine."""
    return {"date": datetime.date.today().isoformat(), "command": command,
            "args": {k: v for k, v in vars(args).items() if k != "func"}, "machine": machine_info()}


def machine_line(machine: dict) -> str:
    return "Machine: " + "; ".join(f"{k} {v}" for k, v in machine.items())


def load_change(load_avg: list[float]) -> str:
    """A [start, end] load average pair as a table cell."""
    return f"{load_avg[0]:.1f} -> {load_avg[1]:.1f}"


def markdown_table(header: list[str], rows: list[list], right_aligned: tuple[int, ...] = ()) -> list[str]:
    """The lines of a markdown table; cells are written with str()."""
    def line(cells):
        return "| " + " | ".join(map(str, cells)) + " |"

    rule = ["---:" if i in right_aligned else "---" for i in range(len(header))]
    return [line(header), "|" + "|".join(rule) + "|"] + [line(r) for r in rows]


def pyplot():
    """matplotlib.pyplot, drawing to files only (the Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_report(out: str, report: dict, markdown, plot) -> None:
    """<out>.json, <out>.md and <out>.png of a report; markdown and plot are the benchmark's own."""
    write_text(out + ".json", json.dumps(report, indent=1))
    write_text(out + ".md", markdown(report))
    plot(report, out + ".png")


def publish(title: str, module: str, argv: list[str] | None, out: str | None, *body: str) -> str:
    """A results file's text: the title, the command and the machine, then `body`'s paragraphs and
    tables (lines); printed, and written to `out` (notes below the marker kept) when given."""
    text = "\n".join([f"# {title}", "", f"Command: `{command_line(module, argv)}`  ", machine_line(machine_info()), "",
                      *body, ""])
    print(text)
    if out:
        write_keeping_notes(out, text)
    return text


def write_keeping_notes(path: str, text: str) -> None:
    """Rewrites a results file, keeping what stands from NOTES_MARKER on (notes written by hand)."""
    write_text(path, text + "\n" + kept_notes(path))


def kept_notes(path: str) -> str:
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    return text[text.index(NOTES_MARKER):] if NOTES_MARKER in text else NOTES_MARKER + "\n"


def load_trace(trace_dir: str):
    """The jax.profiler.ProfileData of the trace written under trace_dir."""
    from jax.profiler import ProfileData
    return ProfileData.from_file(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])


def gpu_kernel_times(trace_dir: str) -> tuple[collections.Counter, int, list[str]]:
    """(ns per kernel name, ns the GPU was busy: the union of the kernels' intervals, the names of
    the GPU planes' lines) over the lines of the GPU's streams."""
    data = load_trace(trace_dir)
    totals, intervals, lines = collections.Counter(), [], []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines.append(line.name)
            if not line.name.startswith("Stream"):   # derived lines ("XLA Ops", ...) repeat the kernels
                continue
            for e in line.events:
                totals[re.sub(r"\.\d+", "", e.name)[:90]] += e.duration_ns
                intervals.append((e.start_ns, e.start_ns + e.duration_ns))
    busy, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return totals, busy, lines


def cuda_api_times(trace_dir: str) -> tuple[collections.Counter, collections.Counter, list[str]]:
    """(ns, calls) per CUDA API call the host made (CUPTI's host plane), and the names of all the
    planes: where the host waits on the GPU (a synchronize, a copy to the host) or launches too
    much, the calls show it."""
    ns, calls, planes = collections.Counter(), collections.Counter(), []
    for plane in load_trace(trace_dir).planes:
        planes.append(plane.name)
        if plane.name.startswith("/host:CUPTI"):
            for e in (e for line in plane.lines for e in line.events):
                ns[e.name] += e.duration_ns
                calls[e.name] += 1
    return ns, calls, planes


def print_gpu_profile(trace_dir: str, traced: int, wall_s: float, top: int) -> None:
    api_ns, api_calls, planes = cuda_api_times(trace_dir)
    print(f"planes: {planes}")
    print("| CUDA API call (host) | calls a step | ms a step |\n|---|---|---|")
    for name, ns in api_ns.most_common(6):
        print(f"| {name} | {api_calls[name] / traced:.1f} | {ns / 1e6 / traced:.3f} |")
    totals, busy, lines = gpu_kernel_times(trace_dir)
    print(f"GPU plane lines: {sorted(set(lines))}")
    print(f"GPU busy {busy / 1e6 / traced:.2f} ms a step of {1e3 * wall_s / traced:.2f} ms wall (profiler on): "
          f"{busy / 1e9 / wall_s:.0%}")
    kernels = sum(totals.values())
    print("| kernel | ms a step | share |\n|---|---|---|")
    for name, ns in totals.most_common(top):
        print(f"| {name} | {ns / 1e6 / traced:.3f} | {ns / max(kernels, 1):.1%} |")


def trace_calls(fn, *args, calls: int = 5) -> tuple[str, float]:
    """Trace `calls` calls of fn(*args) (compiled already): the trace's folder, their wall seconds."""
    import jax
    trace_dir = tempfile.mkdtemp(prefix="jaxserve-trace-")
    jax.profiler.start_trace(trace_dir)
    start = time.perf_counter()
    jax.block_until_ready([fn(*args) for _ in range(calls)])
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    return trace_dir, wall


def gpu_busy_ms(fn, *args, calls: int = 5) -> float:
    """ms a call of fn(*args) keeps the GPU busy: its kernels' own time, without the host's."""
    trace_dir, _ = trace_calls(fn, *args, calls=calls)
    busy = gpu_kernel_times(trace_dir)[1]
    shutil.rmtree(trace_dir, ignore_errors=True)
    return busy / 1e6 / calls


def profile_gpu(label: str, fn, *args, calls: int = 5, top: int = 12) -> None:
    """Trace `calls` calls of fn(*args) (compiled already) and print print_gpu_profile's table."""
    trace_dir, wall = trace_calls(fn, *args, calls=calls)
    print(f"profile: {label}, {calls} calls")
    print_gpu_profile(trace_dir, calls, wall, top)
