"""Multi-device checks, run by tests/test_parallel.py in one subprocess with 8 fake CPU devices:
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.parallel_checks MODEL_DIR [check ...]
prints one JSON line, {check: its measured values, or {"error": traceback}}, for the given checks
(all by default) on the engine model saved at MODEL_DIR (tests.hf_models.save_engine_model); the
pytest side asserts on them. One process for all: jax, the models and the one-device references
are loaded once. Reference:
jaxserve.generate.greedy_generate on one device (contiguous cache, no mesh, no sharding).
tests/test_expert_parallel.py uses its generation helpers.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.hlo_collectives import hlo_collectives
from jaxserve import checkpoint, parallel
from jaxserve.compilations import CompileCounter
from jaxserve.config import ModelConfig
from jaxserve.generate import _step as generate_step, contiguous_kv_cache, greedy_generate
from jaxserve.kv_cache import KVCache
from jaxserve.models import build_model
from jaxserve.sequence_parallel import sequence_parallel_prefill
from jaxserve.step import model_step

PAGE_SIZE = 4
NUM_PAGES = 24
NEW_TOKENS = 4
STEP_TOKENS = 24  # every step is padded to this many tokens, so each mesh compiles one step
STEP_MAX_Q = 16


def hf_config(num_kv_heads: int, qkv_bias: bool, tied: bool) -> dict:
    """A small random Llama (Qwen2 when qkv_bias): 8 heads of 16 (the Mosaic GPU paged kernel
    takes head_dim in multiples of 16), 2 layers, vocab 256."""
    return {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": num_kv_heads, "head_dim": 16,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": tied,
    }


CONFIGS = {
    "even": hf_config(8, qkv_bias=True, tied=False),   # every head count divides TP 2, 4, 8
    "gqa2": hf_config(2, qkv_bias=False, tied=True),   # 2 kv heads: replicated K/V under TP 4
    "mqa": hf_config(1, qkv_bias=False, tied=False),   # 1 kv head (as DeepSeek's latent): replicated, q heads split
    # ALiBi (BLOOM), 4 heads of 16: under TP 2 each device's kernels take their two heads' slopes
    # (4 heads, not 8: the interpreted kernels cost by the KV heads a device holds, 21 s not 32).
    "alibi": {"architectures": ["BloomForCausalLM"], "vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4},
}


@functools.cache
def model_and_params(name: str):
    """The config and random params as host arrays (no init compile; device_put slices them)."""
    cfg = ModelConfig.from_hf_dict(CONFIGS[name])
    rng = np.random.default_rng(1)
    shapes = checkpoint.param_shapes(cfg)
    params = jax.tree.map(lambda s: (0.1 * rng.standard_normal(s.shape) + (len(s.shape) == 1))
                          .astype(np.float32), shapes)
    return cfg, params


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, 13).tolist(), rng.integers(0, 256, 7).tolist()]


def page_rows() -> np.ndarray:
    """Scattered (not contiguous) pages per sequence, so the page table matters."""
    order = np.random.default_rng(1).permutation(NUM_PAGES).astype(np.int32)
    return order.reshape(2, NUM_PAGES // 2)


def make_step(model, mesh, cfg, backend="xla", num_prefill_rows=None):
    """The engine runner's jitted step on `mesh` (KV donated, logits gathered), over arrays
    from step_args; all rows in one attention group padded to STEP_MAX_Q."""
    return functools.partial(model_step, model, backend=backend, num_prefill_rows=num_prefill_rows,
                             max_q=STEP_MAX_Q, kv_sharding=parallel.kv_cache_sharding(cfg, mesh),
                             logits_sharding=parallel.logits_sharding(cfg, mesh))


def empty_cache(cfg, mesh):
    return KVCache.zeros(cfg, mesh, NUM_PAGES, PAGE_SIZE, jnp.float32)


def step_args(new_tokens: list[list[int]], starts: list[int], rows: np.ndarray):
    """The runner's step arrays (tokens, positions, slots, page table, seq_lens, query_start_loc,
    logits index, then token_src and last_sampled: no token taken from a previous step) when
    sequence i brings new_tokens[i] after starts[i] cached tokens."""
    lens = np.array([len(t) for t in new_tokens], np.int32)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pad = STEP_TOKENS - qsl[-1]
    tokens = np.concatenate(new_tokens + [[0] * pad]).astype(np.int32)
    positions = np.concatenate([s + np.arange(n) for s, n in zip(starts, lens)]).astype(np.int32)
    seq = np.repeat(np.arange(len(lens)), lens)
    slots = rows[seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
    pad_slots = np.full(pad, NUM_PAGES * PAGE_SIZE)  # out of range: padding is not written
    return (tokens, np.concatenate([positions, np.zeros(pad)]).astype(np.int32),
            np.concatenate([slots, pad_slots]).astype(np.int32), rows,
            np.asarray(starts, np.int32) + lens, qsl, qsl[1:] - 1,
            np.full(STEP_TOKENS, -1, np.int32), np.zeros(len(lens), np.int32))


def decode_args(tokens, lens):
    return step_args([[t] for t in tokens], [n - 1 for n in lens], page_rows())


def sharded_generate(cfg, params, mesh, sequence_parallel: bool, backend: str = "xla"):
    """Greedy generation on `mesh`: one ragged prefill step, or sequence-parallel prefills
    (the first prompt's first PREFIX tokens already cached by a plain step, the second whole),
    then batched decode steps. Returns tokens and the logits behind each."""
    model = build_model(cfg)
    # Both rows count as prefill rows (one attention group, as None would): the Pallas backends'
    # flash branch runs for the fresh prompts, under the KV-head shard_map, and the paged one
    # for the decodes.
    step = make_step(model, mesh, cfg, backend, num_prefill_rows=None if sequence_parallel else 2)
    kv = empty_cache(cfg, mesh)
    ps, rows = prompts(), page_rows()
    lens = np.array([len(p) for p in ps], np.int32)
    if sequence_parallel:
        prefix = 5
        _, kv, _ = step(params, kv, *step_args([ps[0][:prefix]], [0], rows[:1]))
        out = []
        for i, start in enumerate([prefix, 0]):
            new = ps[i][start:]
            toks = np.zeros(16, np.int32)  # one bucket, a multiple of every seq size tested
            toks[:len(new)] = new
            logits, kv, _ = sequence_parallel_prefill(model, mesh, params, kv, toks, np.int32(len(new)),
                                                   np.int32(start), rows[i])
            out.append(np.asarray(logits)[0])
        logits = np.stack(out)
    else:
        logits, kv, _ = step(params, kv, *step_args(ps, [0, 0], rows))
    all_logits, out = [], []
    for i in range(NEW_TOKENS):
        logits = np.asarray(logits)
        all_logits.append(logits)
        out.append(logits.argmax(-1))
        if i == NEW_TOKENS - 1:
            break
        lens = lens + 1
        logits, kv, _ = step(params, kv, *decode_args(out[-1], lens))
    return np.stack(out, 1), np.stack(all_logits, 1)


def check_generate(meshes: list[tuple]) -> dict:
    """For each (config, mesh shape, sequence_parallel[, attention backend]): greedy tokens equal
    to one device's, and the largest logit difference."""
    results = {}
    refs = {}
    for name, shape, sp, *backend in meshes:
        cfg, params = model_and_params(name)
        if name not in refs:
            refs[name] = greedy_generate(cfg, params, prompts(), NEW_TOKENS, return_logits=True)
        ref_tokens, ref_logits = refs[name]
        mesh = parallel.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])
        sharded = jax.device_put(params, parallel.param_shardings(params, mesh, cfg))
        tokens, logits = sharded_generate(cfg, sharded, mesh, sp, *backend)
        key = f"{name} {shape} {'sp' if sp else 'step'}" + "".join(f" {b}" for b in backend)
        results[key] = {"tokens_equal": tokens.tolist() == ref_tokens,
                        "max_logit_diff": float(np.abs(logits - ref_logits).max())}
    return results


def runner_decode_hlo(name: str, shape: dict, backend: str = "xla") -> str:
    """Compiled HLO of the engine runner's own step, decode-only bucket (2 rows, 4 pages)."""

    cfg, params = model_and_params(name)
    mesh = parallel.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])
    params = jax.device_put(params, parallel.param_shardings(params, mesh, cfg))
    rows, pages = 2, 4
    arrays = (np.zeros(rows, np.int32), np.zeros(rows, np.int32),
              np.full(rows, NUM_PAGES * PAGE_SIZE, np.int32), np.zeros((rows, pages), np.int32),
              np.zeros(rows, np.int32), np.zeros(rows + 1, np.int32), np.zeros(rows, np.int32),
              np.full(rows, -1, np.int32), np.zeros(rows, np.int32))
    return model_step.lower(
        build_model(cfg), params, empty_cache(cfg, mesh), *arrays, backend=backend,
        num_prefill_rows=0, max_q=1, kv_sharding=parallel.kv_cache_sharding(cfg, mesh),
        logits_sharding=parallel.logits_sharding(cfg, mesh)).compile().as_text()


def sp_prefill_hlo(name: str, shape: dict) -> str:
    cfg, params = model_and_params(name)
    mesh = parallel.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))])
    params = jax.device_put(params, parallel.param_shardings(params, mesh, cfg))
    return sequence_parallel_prefill.lower(
        build_model(cfg), mesh, params, empty_cache(cfg, mesh), np.zeros(16, np.int32),
        np.int32(16), np.int32(0), page_rows()[0]).compile().as_text()


def check_hlo() -> dict:
    """Collectives ({op: {group size: count}}) of the runner's decode step under TP 4, and of
    a sequence-parallel prefill under TP 2 x SP 2."""
    def summary(hlo):
        out = collections.defaultdict(collections.Counter)
        for c in hlo_collectives(hlo):
            out[c["op"]][str(c["group"])] += 1
        return out

    out = {f"{name} decode tp4": summary(runner_decode_hlo(name, {"model": 4})) for name in ("even", "gqa2")}
    for backend in ("pallas_gpu", "pallas_tpu"):
        out[f"even decode tp4 {backend}"] = summary(runner_decode_hlo("even", {"model": 4}, backend))
    out["even sp-prefill tp2 sp2"] = summary(sp_prefill_hlo("even", {"model": 2, "seq": 2}))
    return out


def check_param_bytes() -> dict:
    """Load a save_pretrained checkpoint straight into TP 4 shardings; bytes on device 0."""
    cfg, params = model_and_params("even")
    mesh = parallel.make_mesh({"model": 4}, jax.devices()[:4])
    with tempfile.TemporaryDirectory() as d:
        checkpoint.save_pretrained(params, CONFIGS["even"], d)
        loaded = checkpoint.load_params(d, cfg, shardings=parallel.param_shardings(
            checkpoint.param_shapes(cfg), mesh, cfg))
    leaves = jax.tree.leaves(loaded)
    dev = jax.devices()[0]
    per_device = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(leaves, jax.tree.leaves(params)))
    return {"total": sum(x.nbytes for x in leaves), "per_device": per_device,
            "values_equal": bool(same)}


def check_data_parallel(model_dir: str) -> dict:
    """The factory's data-parallel client: two engine replicas, TP 2 each ({"data": 2,
    "model": 2}, on the first 4 devices), against one-device greedy."""
    from jaxserve import factory
    from jaxserve.config import EngineConfig
    from jaxserve.data_parallel import DataParallelEngine
    from jaxserve.sampling_params import SamplingParams

    cfg = ModelConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(3)
    ps = [rng.integers(0, 256, n).tolist() for n in (5, 9, 7, 12, 6, 3)]
    ref = greedy_generate(cfg, checkpoint.load_params(model_dir, cfg), ps, NEW_TOKENS)
    ecfg = EngineConfig(model=model_dir, mesh={"data": 2, "model": 2}, max_num_seqs=4,
                        max_num_batched_tokens=32, prefill_chunk_size=32, max_model_len=64,
                        num_pages=32, page_size=8, compilation_cache_dir=None, step_shapes="largest")
    dp = factory.build_client(ecfg)
    assert isinstance(dp, DataParallelEngine)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    streams = [dp.submit(p, sp) for p in ps]  # all queued before the threads start: few shapes
    dp.start(warmup=False)
    tokens = [[t for out in s for c in out.outputs for t in c.token_ids] for s in streams]
    dp.shutdown()
    return {"tokens_equal": tokens == ref,
            "finished_per_replica": [t.engine.stats["requests_finished"] for t in dp.threads],
            "replica_devices": [sorted(d.id for d in t.engine.runner.mesh.devices.flat)
                                for t in dp.threads],
            "param_devices": [sorted({d.id for x in jax.tree.leaves(t.engine.runner.params)
                                      for d in x.devices()}) for t in dp.threads]}


def prompt_logprobs_reference(cfg, params, prompt: list[int]) -> np.ndarray:
    """log p(prompt[p + 1] | prompt[:p + 1]) for each p: one contiguous-cache forward on one
    device, every position's logits, a float64 log-softmax."""
    n = len(prompt)
    logits, _ = generate_step(build_model(cfg), params, contiguous_kv_cache(cfg, 1, n), np.array(prompt, np.int32),
                              np.arange(n, dtype=np.int32), np.array([n], np.int32), np.array([0, n], np.int32),
                              np.arange(n, dtype=np.int32), max_q=n)
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return logp[np.arange(n - 1), prompt[1:]]


def check_engine_sequence_parallel(model_dir: str, shape: dict) -> dict:
    """The engine on a mesh with a "seq" axis: prefill chunks go through
    sequence_parallel_prefill (counted), chunked prompts reach their cached chunks, decodes run
    in the batched step; greedy tokens against one device, with every page freed or newly taken
    poisoned (NaN: a chunk that read past its sequence's tokens would turn NaN). The 70-token
    prompt asks its prompt logprobs, scored from each chunk's hidden states. Warm-up first, then
    no compilation."""
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.sampling_params import SamplingParams

    cfg = ModelConfig.from_pretrained(model_dir)
    rng = np.random.default_rng(4)
    ps = [rng.integers(0, 256, n).tolist() for n in (5, 40, 70, 23)]  # 70: three 32-token chunks
    ref = greedy_generate(cfg, checkpoint.load_params(model_dir, cfg), ps, NEW_TOKENS)
    ecfg = EngineConfig(model=model_dir, mesh=shape, max_num_seqs=4, max_num_batched_tokens=32,
                        prefill_chunk_size=32, max_prefill_seqs=1, max_model_len=96, num_pages=48,
                        page_size=8, compilation_cache_dir=None, poison_freed_pages=True,
                        step_shapes="largest")
    engine = LLMEngine(ecfg, mesh=parallel.make_mesh(shape, jax.devices()[:int(np.prod(list(shape.values())))]))
    engine.warmup()
    calls, run = [], engine.runner._run

    def counting(name, fn, fixed, args, **static):   # a prefill's args: tokens, num_tokens, num_cached, row
        if name == "sequence_parallel_prefill":
            calls.append(int(args[1]))
        return run(name, fn, fixed, args, **static)
    engine.runner._run = counting
    compiles = CompileCounter.count
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, dataclasses.replace(sp, prompt_logprobs=2) if len(p) == 70 else sp) for p in ps]
    tokens, scored = {i: [] for i in ids}, None
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += [t for c in out.outputs for t in c.token_ids]
            scored = out.prompt_logprobs or scored
    compiles = CompileCounter.count - compiles
    want = prompt_logprobs_reference(cfg, checkpoint.load_params(model_dir, cfg), ps[2])
    return {"tokens_equal": [tokens[i] for i in ids] == ref, "prefill_tokens": sorted(calls),
            "compiles_after_warmup": compiles,
            "prompt_logprobs_tokens_equal": [r.token for r in scored] == ps[2][1:],
            "prompt_logprobs_max_diff": float(np.abs(np.array([r.logprob for r in scored]) - want).max()),
            "prompt_logprobs_tops": [len(r.top) for r in scored][:3]}


# engine_sp first: its count of compilations after warm-up must not find programs that an
# earlier check compiled in this process.
CHECKS = {
    "engine_sp": lambda model_dir: check_engine_sequence_parallel(model_dir, {"model": 2, "seq": 2}),
    "dp": check_data_parallel,
    # The generation cases: each mesh size, kind of KV split and backend at least once, not every
    # combination (suite time: each case is a program of its own; the Pallas ones run their
    # kernels interpreted, 10-30 s each). TP 8 with the KV heads split, TP 4 with them replicated;
    # TP 2 in the TP 2 x SP 2 case (split), the Pallas cases and the engine_sp and dp engines;
    # SP 2 in TP 2 x SP 2. The "even" config at TP 4, and through the Pallas kernels: check_hlo.
    "tp": lambda _: check_generate([("even", {"model": 8}, False), ("gqa2", {"model": 4}, False)]),
    "sp": lambda _: check_generate([("even", {"seq": 4}, True), ("even", {"model": 2, "seq": 2}, True)]),
    # The KV-head shard_map around the Pallas kernels is one piece for both platforms; it runs
    # here with the TPU kernels: split KV heads in the ALiBi case (BLOOM's KV heads are its heads),
    # one replicated in the MQA case. Interpret-mode Mosaic GPU under TP ran past 40 minutes on the
    # 2-core CI box; the GPU kernels' numerics are checked on their own (test_gpu_kernels.py).
    "pallas_tp": lambda _: check_generate([("alibi", {"model": 2}, False, "pallas_tpu"),
                                           ("mqa", {"model": 2}, False, "pallas_tpu")]),
    "hlo": lambda _: check_hlo(),
    "param_bytes": lambda _: check_param_bytes(),
}


def run_checks(model_dir: str, names: list[str]) -> dict:
    """Each check's values, or its traceback: one failing check fails only its own test."""
    results = {}
    for name in names:
        try:
            results[name] = CHECKS[name](model_dir)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


if __name__ == "__main__":
    if jax.device_count() < 8:
        sys.exit("needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8")
    print(json.dumps(run_checks(sys.argv[1], sys.argv[2:] or list(CHECKS))))
