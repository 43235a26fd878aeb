"""The engine on a GPU, two questions on the same weights:
  1. Do the Pallas GPU kernels serve the tokens the XLA path serves? Greedy outputs of
     attention_backend pallas_gpu against xla, request by request (and against transformers).
  2. How fast is the engine against transformers `generate` in static, left-padded batches
     (torch, bf16, SDPA attention, the same GPU)?
Models: the embedded tiny model, a random 1.1B bf16 Llama (Llama-3.2-1B's shapes with a 32k
vocabulary: hidden 2048, 16 layers, 32 heads / 8 KV heads, ffn 8192), seeded, written with
save_pretrained, and `copy`: a small Llama trained here to repeat its prompt (`build_copy`), whose
greedy tokens are decisive where random weights' are near-ties, so that two attention backends
must agree token for token, and both with the prompt. Each phase runs in its own process (JAX and
torch would each claim the GPU's memory) and writes JSON under --out; `report` renders them into
benchmarks/results/engine_<gpu>.md.
benchmarks/on_gpu.sh runs all of it on a lent GPU.

  python -m benchmarks.gpu_engine build --out DIR             # the 1.1B model (hf builds it too)
  python -m benchmarks.gpu_engine build --model copy --out DIR # trains the copy model (seconds on a GPU)
  python -m benchmarks.gpu_engine hf  --model 1b  --out DIR
  python -m benchmarks.gpu_engine jax --model 1b  --out DIR
  python -m benchmarks.gpu_engine report --out DIR
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import os
import time

import numpy as np

from benchmarks.common import Request, make_workload, markdown_table, save_word_tokenizer, write_keeping_notes

LLAMA_1B = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                initializer_range=0.02)
# A Llama trained to copy: prompt (a preamble of COPY_PREAMBLE random ids) BOS x SEP, greedy
# continuation x, COPY_LENGTH random ids: each copied token sits COPY_LENGTH + 1 positions back.
COPY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
COPY_SEP, COPY_LENGTH, COPY_PREAMBLE = 3, 64, (0, 64)
# Per model: prompt lengths, output lengths (both uniform, inclusive), prompts.
WORKLOADS = {"tiny": ((16, 256), (16, 128), 64), "1b": ((32, 512), (32, 256), 128),
             "copy": ((COPY_PREAMBLE[0] + COPY_LENGTH + 2, COPY_PREAMBLE[1] + COPY_LENGTH + 2), (COPY_LENGTH,) * 2, 64)}
# Per model: prompts whose chunks may share a step. The tiny model takes the default (4): its
# steps pack prompts, which the flash kernel keeps apart by segment ids, checked against xla.
# The 1.1B takes 1: a third of the step shapes, a warm-up that fits a lease.
PREFILL_SEQS = {"tiny": 4, "1b": 1, "copy": 4}
BACKENDS = ("pallas_gpu", "xla")


def model_dir(name: str, work_dir: str) -> str:
    if name == "tiny":
        from jaxserve.engine import TINY_MODEL_DIR
        return TINY_MODEL_DIR
    return os.path.join(work_dir, f"llama-{name}")


def build_1b(out_dir: str) -> None:
    """Seeded random weights, initialised on the GPU (seconds, not minutes on the host), saved bf16."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    with torch.device(torch_device()):
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_1B))
    model.to(torch.bfloat16).save_pretrained(out_dir)
    save_word_tokenizer(out_dir, LLAMA_1B["vocab_size"])
    del model
    torch.cuda.empty_cache()


def build_copy(out_dir: str) -> None:
    """Trains COPY (seconds on a GPU, under a minute on the host: ~150 steps) until it copies
    held-out batches behind the shortest, a middle and the longest preamble exactly, every token by
    at least 2 nats over the runner-up, in bf16 as saved: its greedy tokens are decisive, not
    bf16 rounding's pick among near-ties as with random weights."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    device = torch_device()
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**COPY)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)

    def batch(preamble: int, rows: int = 32):
        noise, x = (torch.randint(COPY_SEP + 1, COPY["vocab_size"], (rows, n), device=device)
                    for n in (preamble, COPY_LENGTH))
        bos, sep = (torch.full((rows, 1), t, device=device) for t in (COPY["bos_token_id"], COPY_SEP))
        return torch.cat([noise, bos, x, sep, x], 1), preamble + COPY_LENGTH + 2   # where the copy starts

    @torch.no_grad()
    def copies() -> bool:
        for seq, start in map(batch, (COPY_PREAMBLE[0], sum(COPY_PREAMBLE) // 2, COPY_PREAMBLE[1])):
            logprobs = model(input_ids=seq).logits[:, start - 1:-1].float().log_softmax(-1)
            top2 = logprobs.topk(2, -1).values
            if not ((logprobs.argmax(-1) == seq[:, start:]).all() and (top2[..., 0] - top2[..., 1]).min() > 2):
                return False
        return True

    for step in range(1, 2001):
        seq, start = batch(int(torch.randint(COPY_PREAMBLE[0], COPY_PREAMBLE[1] + 1, ())))
        labels = seq.clone()
        labels[:, :start] = -100
        loss = model(input_ids=seq, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 and copies():
            model.to(torch.bfloat16)
            if copies():
                break
            model.float()
    else:
        raise RuntimeError("the copy model did not learn to copy in 2,000 steps")
    print(f"copy model: copies exactly after {step} steps (loss {loss.item():.4f})", flush=True)
    model.save_pretrained(out_dir)
    save_word_tokenizer(out_dir, COPY["vocab_size"])


def torch_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"   # cpu: a smoke run of this script


def workload(name: str, vocab_size: int):
    inputs, outputs, n = WORKLOADS[name]
    if name == "copy":   # preamble BOS x SEP, x's length to generate: the answer is x
        rng = np.random.default_rng(0)
        prompts = [rng.integers(COPY_SEP + 1, vocab_size, rng.integers(inputs[0], inputs[1] + 1) - 2).tolist()
                   for _ in range(n)]   # preamble and x
        return [Request([*p[:-COPY_LENGTH], COPY["bos_token_id"], *p[-COPY_LENGTH:], COPY_SEP], COPY_LENGTH)
                for p in prompts]
    return make_workload(n, inputs, outputs, vocab_size, seed=0)


def hf_phase(args) -> dict:
    """transformers generate in static batches of each size, after one untimed call."""
    import torch
    import transformers as tf

    from benchmarks.transformers_peers import run_generate

    path = model_dir(args.model, args.work_dir)
    if args.model == "1b" and not os.path.exists(os.path.join(path, "config.json")):
        build_1b(path)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    model = model.to(torch_device()).eval()
    requests = workload(args.model, model.config.vocab_size)
    run_generate(model, requests[:2], 2, 0)
    runs = [run_generate(model, requests, b, 0) for b in args.hf_batch_sizes]
    return {"torch": torch.__version__, "transformers": tf.__version__,
            "runs": [dict(system=r.system, tokens=r.output_tokens, seconds=r.seconds, outputs=r.outputs)
                     for r in runs]}


def jax_phase(args) -> dict:
    """Each backend's engine: warm-up (timed, compilations counted), then the workload twice (the
    first run of each step shape on a GPU pays its first execution; the second is the figure)."""
    import jax

    from benchmarks.offline_throughput import run_engine
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine

    path = model_dir(args.model, args.work_dir)
    (_, max_in), (_, max_out), n = WORKLOADS[args.model]
    max_len = max_in + max_out
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "backends": {}}
    for backend in args.backends:
        ecfg = EngineConfig(model=path, dtype="bfloat16", max_model_len=max_len, page_size=16,
                            num_pages=n * -(-max_len // 16), enable_prefix_caching=False,
                            max_num_seqs=n, max_num_batched_tokens=1024, prefill_chunk_size=512,
                            max_prefill_seqs=PREFILL_SEQS[args.model], attention_backend=backend, compilation_cache_dir=None,
                            quantization=args.quantization, decode_steps=args.decode_steps)
        t0 = time.perf_counter()
        engine = LLMEngine(ecfg)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiles = engine.warmup()
        warmup_s = time.perf_counter() - t0
        requests = workload(args.model, engine.model_cfg.vocab_size)
        runs = [run_engine(backend, engine, requests) for _ in range(2)]
        traced = greedy_with_logprobs(engine, requests)
        out["backends"][backend + variant(args, " ", " decode_steps ")] = dict(
            resolved=engine.runner.backend, load_s=load_s, warmup_s=warmup_s, compiles=compiles,
            tokens=runs[-1].output_tokens, seconds=[r.seconds for r in runs],
            steps=runs[-1].profile.summary(runs[-1].seconds), outputs=runs[-1].outputs, traced=traced)
        print(f"[{args.model} {backend}] warm-up {warmup_s:.1f}s ({compiles} compilations); "
              f"{[round(r.tokens_per_s) for r in runs]} tok/s", flush=True)
        del engine, runs
        gc.collect()
        save(args, out)   # after each backend: a run cut short keeps what it has
    return out


def greedy_with_logprobs(engine, requests, top: int = 5) -> list[list]:
    """The workload once more, greedy with the top-`top` logprobs of every output token: per
    request, [token, [[id, logprob], ...]] per token. Where two backends' greedy outputs part,
    these say whether the step was a near-tie (each side's token in the other's top list)."""
    from jaxserve.sampling_params import SamplingParams

    ids = [engine.add_request(r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=r.max_tokens,
                                                                 ignore_eos=True, logprobs=top))
           for r in requests]
    got = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.outputs[0].logprobs)
    return [[[res.token, [list(t) for t in res.top]] for res in got[i]] for i in ids]


def near_ties(a: list[list], b: list[list]) -> str:
    """Of the requests whose traced greedy outputs differ: at the first differing token, how many
    have each side's token in the other's top list, and b's top-1 minus top-2 logprob there."""
    found = []
    for x, y in zip(a, b):
        i = first_difference([t for t, _ in x], [t for t, _ in y])
        if i is None or i >= min(len(x), len(y)):
            continue
        (ta, top_a), (tb, top_b) = x[i], y[i]
        found.append((ta in {t for t, _ in top_b} and tb in {t for t, _ in top_a}, top_b[0][1] - top_b[1][1]))
    if not found:
        return f"all {len(a)} traced outputs identical"
    gaps = sorted(g for _, g in found)
    return (f"{len(a) - len(found)} of {len(a)} traced outputs identical; where the others part, "
            f"{sum(c for c, _ in found)} of {len(found)} pick tokens in each other's top {len(a[0][0][1])}, "
            f"top-2 logprob gap there median {gaps[len(gaps) // 2]:.3f}, largest {gaps[-1]:.3f} nats")


def logprob_gaps(a: list[list], b: list[list]) -> str:
    """Over the tokens where two traced greedy outputs still agree (the same context on both
    sides): |a's logprob - b's logprob| of that token, median and largest. bf16 rounding keeps it to
    hundredths; a kernel that is wrong shows here even where it changes no greedy token."""
    gaps = []
    for x, y in zip(a, b):
        same = first_difference([t for t, _ in x], [t for t, _ in y])
        for (t, top_x), (_, top_y) in zip(x[:same], y[:same]):
            gaps.append(abs(dict(map(tuple, top_x))[t] - dict(map(tuple, top_y))[t]))
    gaps.sort()
    return (f"|logprob difference| of the {len(gaps)} tokens before the outputs part: median "
            f"{gaps[len(gaps) // 2]:.4f}, largest {gaps[-1]:.4f} nats") if gaps else "no tokens in common"


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """'k of n requests identical; others differ from token i (median)'."""
    diffs = [first_difference(x, y) for x, y in zip(a, b)]
    differ = sorted(d for d in diffs if d is not None)
    text = f"{len(diffs) - len(differ)} of {len(diffs)} identical"
    return text + (f"; the others from token {differ[len(differ) // 2]} (median), {differ[0]} (first)"
                   if differ else "")


def load(out_dir: str, name: str) -> dict | None:
    """A phase's JSON file (`save`), or None where that phase wrote none."""
    path = os.path.join(out_dir, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def report(out_dir: str, models: list[str]) -> str:
    lines = ["# The engine on a GPU", ""]
    for name in models:
        jx, hf = load(out_dir, f"jax_{name}"), load(out_dir, f"hf_{name}")
        if jx is None:
            lines += [f"## {name}: no jaxserve result (see the run's log)", ""]
            continue
        for path in sorted(glob.glob(os.path.join(out_dir, f"jax_{name}_*.json"))):   # variants: more rows
            jx["backends"].update(load(out_dir, os.path.basename(path)[:-5])["backends"])
        (lo_in, hi_in), (lo_out, hi_out), n = WORKLOADS[name]
        what = ("a preamble, BOS, x, SEP (the copy model: `build_copy`), seeded random ids" if name == "copy"
                else "seeded random token ids")
        lines += [f"## {name} on {jx['device']} (jax {jx['jax']})", "",
                  f"{n} prompts of {what}, input {lo_in}-{hi_in}, output {lo_out}-{hi_out} "
                  "tokens (forced: ignore_eos), greedy, bf16. jaxserve: max_num_seqs = all prompts, 1024 "
                  f"tokens a step, prefill chunks of at most 512 from up to {PREFILL_SEQS[name]} prompt(s) a step, page "
                  "size 16, no preemption; the workload run twice "
                  "after warm-up (the second run counts).", ""]
        backends = jx["backends"]
        rows = [[b, r["resolved"], f"{r['warmup_s']:.1f}", r["compiles"],
                 " / ".join(f"{r['tokens'] / s:.0f}" for s in r["seconds"]),
                 f"{r['steps']['decode_step_ms']:.2f}", f"{r['steps']['prefill_step_ms']:.2f}"]
                for b, r in backends.items()]
        best_hf = None
        if hf:
            for run in hf["runs"]:
                rows.append([run["system"], f"torch {hf['torch']}, SDPA", "", "", f"{run['tokens'] / run['seconds']:.0f}",
                             "", ""])
            best_hf = max(hf["runs"], key=lambda r: r["tokens"] / r["seconds"])
        lines += markdown_table(["system", "attention", "warm-up s", "compilations", "output tok/s (run 1 / 2)",
                                 "ms per decode step", "ms per prefill step"], rows) + [""]
        if "pallas_gpu" in backends and "xla" in backends:
            pallas, xla = backends["pallas_gpu"], backends["xla"]
            lines.append("- Greedy outputs, pallas_gpu vs xla: " + agreement(pallas["outputs"], xla["outputs"])
                         + ". Again with top-5 logprobs: " + near_ties(pallas["traced"], xla["traced"]) + "; "
                         + logprob_gaps(pallas["traced"], xla["traced"]) + ".")
        for b, r in backends.items():   # a variant against the same backend with the defaults
            base = backends.get(b.split(" ")[0])
            if " decode_steps " in b and base is not None:
                lines.append(f"- Greedy outputs, {b} vs {b.split(' ')[0]}: " + agreement(r["outputs"], base["outputs"]) + ".")
        if name == "copy":   # the answer: each prompt's x
            xs = [r.prompt_token_ids[-COPY_LENGTH - 1:-1] for r in workload(name, COPY["vocab_size"])]
            lines.append("- Exact copies of the prompt: " + "; ".join(
                f"{b} {sum(out == x for out, x in zip(r['outputs'], xs))} of {len(xs)}" for b, r in backends.items()) + ".")
        for b, r in backends.items():
            if best_hf:
                tps = r["tokens"] / r["seconds"][-1]
                lines.append(f"- {b} / {best_hf['system']}: **{tps / (best_hf['tokens'] / best_hf['seconds']):.2f}x**; "
                             "greedy outputs vs transformers: " + agreement(r["outputs"], best_hf["outputs"]) + ".")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("phase", choices=("build", "hf", "jax", "report"))
    p.add_argument("--model", choices=tuple(WORKLOADS), default="1b")
    p.add_argument("--models", default="tiny,copy,1b", help="report: the models to render")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--quantization", choices=("int8",), default=None, help="jax: int8 weights")
    p.add_argument("--decode-steps", type=int, default=1, help="jax: EngineConfig.decode_steps")
    p.add_argument("--hf-batch-sizes", default="64,128")
    p.add_argument("--work-dir", default="/tmp/jaxserve_gpu")
    p.add_argument("--out", required=True, help="the phases' JSON files")
    p.add_argument("--results", default=None, help="report: also write the tables into this markdown file")
    args = p.parse_args(argv)
    args.backends = args.backends.split(",")
    args.hf_batch_sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
    os.makedirs(args.out, exist_ok=True)
    if args.phase == "build":
        (build_copy if args.model == "copy" else build_1b)(model_dir(args.model, args.work_dir))
        return
    if args.phase == "report":
        text = report(args.out, args.models.split(","))
        print(text)
        if args.results:
            write_keeping_notes(args.results, text)
        return
    save(args, hf_phase(args) if args.phase == "hf" else jax_phase(args))


def variant(args, quantized: str, stepped: str) -> str:
    """The jax phase's settings beside the defaults (int8 weights, decode_steps), each after its prefix."""
    return ((quantized + args.quantization if args.quantization else "")
            + (f"{stepped}{args.decode_steps}" if args.decode_steps > 1 else ""))


def save(args, result: dict) -> None:
    suffix = variant(args, "_", "_x") if args.phase == "jax" else ""
    with open(os.path.join(args.out, f"{args.phase}_{args.model}{suffix}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
