"""Differential bug hunt: random engine configurations against a reference engine, on the
embedded tiny model and the same random requests.

The reference runs the synchronous loop (no overlap), one decode step a program, no speculation,
no prefix caching. Each round draws requests over the whole sampling-parameter space (greedy and
seeded, top-k/top-p/min-p, penalties, logit bias, min_tokens, n, logprobs, prompt logprobs, regex
grammars; stop tokens and stop strings taken from what the reference generated, so that they hit)
and an engine configuration (page size, batch and chunk sizes, small pools that preempt, prefix
caching, poisoned freed pages, overlap, multi-step decodes, n-gram or draft-model speculation).
Every output (token ids, text, finish reason) must equal the reference's: the engine promises
that seeded sampling does not depend on the batch. Logprobs must agree to 1e-3 and their ranks
to 2 places (near-ties move a rank on float noise). No step may fail; every page comes back.

    python scripts/fuzz_engine.py --seeds 0:6            # six rounds (a new process every few:
                                                         # each engine built keeps its executables)
    KV=int8 QUANT=int8 python scripts/fuzz_engine.py     # quantized reference and variants alike
    XLA_FLAGS=--xla_force_host_platform_device_count=8 TP=2 SP=2 python scripts/fuzz_engine.py
                                                         # on a mesh (sequence-parallel prefill: no
                                                         # prompt logprobs)

Found so far (fixed): a penalised request's stop failing its whole step (the deferred sampler
read a negative PENDING count), min_tokens' ban emptying a grammar's allowed set, and
sequence-parallel prefill reading past the prompt (NaN from poisoned pages, on SP=2).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
import traceback

import numpy as np

from jaxserve import LLM
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutput

REFERENCE = dict(max_model_len=160, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False,
                 compilation_cache_dir="/tmp/jaxserve-fuzz", kv_cache_dtype=os.environ.get("KV", "auto"),
                 quantization=os.environ.get("QUANT") or None,
                 mesh={"data": 1, "model": int(os.environ.get("TP", 1)), "seq": int(os.environ.get("SP", 1))})
REGEXES = [r"[a-z ]{2,30}\.", r"(yes|no|maybe)!", r"[0-9]+(,[0-9]+)*"]


def sampling(rng) -> dict:
    kw = dict(max_tokens=int(rng.integers(1, 50)), ignore_eos=bool(rng.random() < 0.6))
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=float(rng.choice([0.5, 1.0, 1.5])), seed=int(rng.integers(0, 1000)))
        for name, values, p in [("top_k", [1, 5, 40], 0.3), ("top_p", [0.3, 0.9], 0.3), ("min_p", [0.05, 0.3], 0.2),
                                ("n", [2, 3], 0.3)]:
            if rng.random() < p:
                kw[name] = rng.choice(values).item()
    for name, values, p in [("repetition_penalty", [0.8, 1.2, 1.5], 0.3), ("presence_penalty", [-1.0, 0.5, 1.5], 0.3),
                            ("frequency_penalty", [-0.5, 0.5, 1.0], 0.3), ("logprobs", [0, 1, 3], 0.3),
                            ("prompt_logprobs", [0, 2], 0.2 if REFERENCE["mesh"]["seq"] == 1 else 0)]:
        if rng.random() < p:
            kw[name] = rng.choice(values).item()
    if rng.random() < 0.2:
        kw["logit_bias"] = {int(t): float(rng.choice([-5, 3, 8])) for t in rng.integers(3, 4000, 3)}
    if rng.random() < 0.15:
        kw["structured_output"] = StructuredOutput("regex", str(rng.choice(REGEXES)))
    if rng.random() < 0.2:
        kw["min_tokens"] = int(rng.integers(0, kw["max_tokens"] + 1))
    return kw


def with_stops(rng, kw: dict, generated: tuple) -> dict:
    """Stops that hit: one of the tokens, or a piece of the text, the reference generated."""
    tokens, _, text = generated
    if tokens and rng.random() < 0.5:
        kw["stop_token_ids"] = [tokens[int(rng.integers(0, len(tokens)))]]
    if len(text) > 2 and rng.random() < 0.4:
        i = int(rng.integers(0, len(text) - 1))
        kw.update(stop=[text[i:i + int(rng.integers(1, 3))]], include_stop_str_in_output=bool(rng.random() < 0.5))
    return kw


def engine_config(rng) -> dict:
    c = dict(page_size=int(rng.choice([8, 16, 32])), max_num_seqs=int(rng.integers(1, 12)),
             max_num_batched_tokens=int(rng.choice([32, 64, 128, 256])), max_prefill_seqs=int(rng.integers(1, 5)),
             enable_prefix_caching=bool(rng.random() < 0.7), poison_freed_pages=bool(rng.random() < 0.3))
    c["prefill_chunk_size"] = min(int(rng.choice([16, 32, 64, 256])), c["max_num_batched_tokens"])
    if rng.random() < 0.5:   # a pool that preempts
        c["num_pages"] = int(rng.integers(160 // c["page_size"] + 1, 80))
    kind = rng.random()
    if kind < 0.2:
        c["speculative"] = SpeculativeConfig(num_tokens=int(rng.integers(1, 5)), disable_by_batch_size=64)
    elif kind < 0.3:
        c["speculative"] = SpeculativeConfig(method="draft", model=os.path.join(TINY_MODEL_DIR, "draft"),
                                             num_tokens=int(rng.integers(1, 5)))
    elif kind < 0.6:
        c["decode_steps"] = int(rng.choice([2, 4]))
    return c


@dataclasses.dataclass
class Outputs:
    choices: list     # per request: [(token ids, finish reason, text)] per choice
    logprobs: list    # per request: [(keys, values)] for its prompt logprobs, then per choice


def logprob_entries(entries) -> tuple[list, list]:
    """[(position, token id, rank)], [logprob] of {id: Logprob} entries (or Nones)."""
    keys, values = [], []
    for i, entry in enumerate(entries or []):
        for token, lp in (entry or {}).items():
            keys.append((i, token, lp.rank))
            values.append(lp.logprob)
    return keys, values


def run(llm: LLM, prompts: list, params: list) -> Outputs:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return Outputs([[(list(c.token_ids), c.finish_reason, c.text) for c in o.outputs] for o in outs],
                   [[logprob_entries(o.prompt_logprobs)] + [logprob_entries(c.logprobs) for c in o.outputs]
                    for o in outs])


def logprobs_agree(want: list, got: list) -> bool:
    for (wk, wv), (gk, gv) in zip(want, got):
        if [k[:2] for k in wk] != [k[:2] for k in gk]:
            return False
        if any((a[2] is None) != (b[2] is None) or (a[2] is not None and abs(a[2] - b[2]) > 2) for a, b in zip(wk, gk)):
            return False
        if wv and np.abs(np.array(wv) - np.array(gv)).max() > 1e-3:
            return False
    return True


def one_round(reference: LLM, seed: int) -> bool:
    """One random workload and configuration; prints what differs; True when nothing does."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(3, 12))
    shared = rng.integers(3, 4000, 60).tolist()   # a prefix some prompts share (prefix caching)
    prompts = [(shared[:int(rng.integers(0, 50))] if rng.random() < 0.6 else []) +
               rng.integers(3, 4000, int(rng.integers(1, 60))).tolist() for _ in range(k)]
    kws = [sampling(rng) for _ in range(k)]
    first = run(reference, prompts, [SamplingParams(**kw) for kw in kws])
    params = [SamplingParams(**with_stops(rng, kw, choices[0])) for kw, choices in zip(kws, first.choices)]
    want = run(reference, prompts, params)
    config, overlap = engine_config(rng), bool(rng.random() < 0.8)
    start = time.time()
    try:
        llm = LLM(**{**REFERENCE, **config})
        llm.llm_engine.overlap = overlap
        got = run(llm, prompts, params)
    except Exception:
        print(f"seed {seed} {config} overlap {overlap}: RAISED", flush=True)
        traceback.print_exc()
        for p in params:
            print("   ", p)
        return False
    bm = llm.llm_engine.block_manager
    differ = [i for i in range(k) if want.choices[i] != got.choices[i]]
    logprobs = [i for i in range(k) if i not in differ and not logprobs_agree(want.logprobs[i], got.logprobs[i])]
    leak = bm.num_free_pages != bm.num_pages
    print(f"seed {seed} {time.time() - start:.0f}s {config} overlap {overlap}: {k} requests, outputs differ "
          f"{differ}, logprobs differ {logprobs}, pages leaked {leak}", flush=True)
    for i in differ[:3] + logprobs[:2]:
        print(f"   request {i}: {params[i]}, {len(prompts[i])} prompt tokens\n     want {want.choices[i]}\n"
              f"     got  {got.choices[i]}", flush=True)
    return not (differ or logprobs or leak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0:6", help="first:end of the rounds' seeds")
    args = parser.parse_args()
    first, end = (int(x) for x in args.seeds.split(":"))
    reference = LLM(**REFERENCE)
    reference.llm_engine.overlap = False
    failed = [seed for seed in range(first, end) if not one_round(reference, seed)]
    print(f"{end - first - len(failed)} of {end - first} rounds agree; differing: {failed}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
