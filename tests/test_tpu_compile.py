"""Compiled for real TPUs: XLA:TPU and Mosaic from libtpu, on compile-only devices of each
generation (jax.experimental.topologies), no TPU attached. What they refuse, a chip refuses.

libtpu is part of the test install (`make test`); without it these tests fail, they do not skip.
  * the Pallas TPU kernels over a covering design of shapes (every pair of values of any two
    axes, generation included, appears in some compiled configuration), and gpt-oss's sinks;
  * the engine's step, one generation per model and mesh (its kernels: above), through `jaxserve
    check`'s own code (every bucket: `jaxserve check`), no step copying a whole KV pool: the
    embedded model's default config on v6e-1 (with its multi-step decode and sampler variants),
    Llama-3-8B shapes on one chip and under TP 8, BLOOM-560m shapes (ALiBi) under TP 4;
  * a small Qwen3-MoE with int4 experts on v6e;
  * the embedded model with its draft model on v5e-1: both sized and compiled, as the engine sizes them;
  * Llama-3-8B bf16 on one v5e chip is refused, with what would fit.
"""
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import os
import threading

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # xdist workers each load libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from jaxserve import check, cli, parallel, sizing
from jaxserve.buckets import Buckets
from jaxserve.checkpoint import param_shapes
from jaxserve.config import EngineConfig, ModelConfig
from pallas_kernels.flash_attention import tpu as flash_tpu
from pallas_kernels.flash_attention.tpu import flash_attention
from pallas_kernels.paged_attention import tpu as paged_tpu
from pallas_kernels.paged_attention.tpu import ragged_paged_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_8B = os.path.join(ROOT, "configs", "models", "llama3-8b")
TINY = os.path.join(ROOT, "jaxserve", "assets", "tiny")
# libtpu topology names of every generation it knows (tpu7x: the newest in libtpu 0.0.42).
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}


_topology_lock = threading.Lock()   # two threads making libtpu's first topology: "PJRT_Api already exists"


@functools.cache
def device(generation: str):
    with _topology_lock:
        return topologies.get_topology_desc(platform="tpu", topology_name=GENERATIONS[generation]).devices[0]


def covering(axes: dict[str, list]) -> list[dict]:
    """Rows of a pairwise covering design: every pair of values of any two axes is in some row.
    Greedy (each row the first candidate, in product order, that covers most uncovered pairs),
    deterministic. In numpy: as Python sets, the grids' 35k candidates took 2 s."""
    sizes = [len(values) for values in axes.values()]
    candidates = np.array(list(itertools.product(*map(range, sizes))))   # value indices
    pair_ids, num_pairs = [], 0   # pair (axis i, value a, axis j, value b) of i < j, numbered
    for i, j in itertools.combinations(range(len(sizes)), 2):
        pair_ids.append(num_pairs + candidates[:, i] * sizes[j] + candidates[:, j])
        num_pairs += sizes[i] * sizes[j]
    pair_ids = np.stack(pair_ids, axis=1)   # [candidates, pairs of axes]
    uncovered = np.ones(num_pairs, bool)
    rows = []
    while uncovered.any():
        best = np.argmax(uncovered[pair_ids].sum(axis=1))
        uncovered[pair_ids[best]] = False
        rows.append({name: values[k] for (name, values), k in zip(axes.items(), candidates[best])})
    return rows


def abstract(shape, dtype, dev):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=SingleDeviceSharding(dev))


def compile_all(configs, lower) -> list[str]:
    """Lower and compile each config, os.cpu_count() at a time (Mosaic compiles on one thread, without
    the GIL; no kernel offloads to a SparseCore, which compiles only alone); the failures, a line each."""
    def failure(c) -> str | None:
        try:
            lower(c).compile()
        except Exception as e:  # collect every refusal, then fail once with all of them
            return f"{c}: {str(e).strip().splitlines()[0][:300]}"
        return None

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as executor:
        return [f for f in executor.map(failure, configs) if f]


KERNEL_AXES = {
    "generation": list(GENERATIONS),
    "head_dim": [64, 128, 256],
    "kv_heads": [1, 2, 8],
    "group": [1, 4, 8],          # query heads per KV head (GQA)
    "dtype": ["float32", "bfloat16"],
    "window": [None, 256],
    "scores": ["plain", "soft_cap", "alibi", "soft_cap+alibi"],   # pallas_kernels/scores.py
}
# Batches: (rows' new tokens) of decode-only, mixed, and prefill steps. The prompt's 512 tokens
# make q blocks as large as 2048 would (block_q is capped at block_rows // group: paged_attention/
# tpu.py): the same kernel, a quarter of XLA's compile time (4.2 -> 0.9 s for 8 KV heads on v5e).
BATCHES = {"decode": [1] * 16, "mixed": [96, 7, 1, 1, 1, 1], "prefill": [512]}


def soft_cap(c) -> float | None:
    return 30.0 if "soft_cap" in c["scores"] else None


def per_head(c, name, num_heads, dev):
    """A config's per-head argument `name` ("alibi" slopes, "sinks"; f32[heads], abstract), or None."""
    return abstract((num_heads,), jnp.float32, dev) if name in c["scores"] else None


def lower_paged(c):
    dev, dtype, q_lens = device(c["generation"]), jnp.dtype(c["dtype"]), BATCHES[c["batch"]]
    pages_per_seq = 4096 // c["page_size"]    # contexts up to 4k tokens
    t, s = sum(q_lens), len(q_lens)
    q = abstract((t, c["kv_heads"] * c["group"], c["head_dim"]), dtype, dev)
    pages = abstract((s * pages_per_seq, c["kv_heads"], c["page_size"], c["head_dim"]), dtype, dev)
    tables = (abstract((s, pages_per_seq), jnp.int32, dev), abstract((s,), jnp.int32, dev),
              abstract((s + 1,), jnp.int32, dev))
    kernel = functools.partial(ragged_paged_attention, max_q=max(q_lens), sm_scale=0.1,
                               sliding_window=c["window"], soft_cap=soft_cap(c), interpret=False)
    return jax.jit(kernel).lower(q, pages, pages, *tables, alibi_slopes=per_head(c, "alibi", q.shape[1], dev),
                                 sinks=per_head(c, "sinks", q.shape[1], dev))


def lower_flash(c):
    dev, dtype, t = device(c["generation"]), jnp.dtype(c["dtype"]), c["tokens"]
    q = abstract((1, t, c["kv_heads"] * c["group"], c["head_dim"]), dtype, dev)
    kv = abstract((1, t, c["kv_heads"], c["head_dim"]), dtype, dev)
    seg = abstract((1, t), jnp.int32, dev) if c["segments"] > 1 else None
    kernel = functools.partial(flash_attention, sliding_window=c["window"], soft_cap=soft_cap(c), interpret=False)
    return jax.jit(lambda q, k, v, seg, slopes, sinks: kernel(q, k, v, segment_ids=seg, alibi_slopes=slopes,
                                                              sinks=sinks)).lower(
        q, kv, kv, seg, per_head(c, "alibi", q.shape[2], dev), per_head(c, "sinks", q.shape[2], dev))


# gpt-oss's attention (sinks, 64 query heads over 8 KV heads of 64 lanes, a 128-token window) on two
# generations, beside the grid (a fifth `scores` value would add a row for each of its pairs).
GPT_OSS = dict(head_dim=64, kv_heads=8, group=8, dtype="bfloat16", window=128, scores="sinks",
               page_size=16, batch="mixed", tokens=2048, segments=5)
# Each kernel's lowering and own axes; flash: prefill only (the engine's fresh-prefill path), a
# long sequence or short packed segments.
GRIDS = {"paged": (lower_paged, {"page_size": [16, 32, 64, 128], "batch": list(BATCHES)}),
         "flash": (lower_flash, {"tokens": [512, 2048], "segments": [1, 5]})}


@pytest.mark.parametrize("kernel", GRIDS)
def test_kernel_compiles_for_every_generation(kernel):
    lower, axes = GRIDS[kernel]
    configs = covering({**KERNEL_AXES, **axes}) + [dict(GPT_OSS, generation=g) for g in ("v5e", "v6e")]
    failures = compile_all(configs, lower)
    print(f"{kernel} kernel: {len(configs)} configs x generations compiled, {len(failures)} failed")
    assert not failures, "\n".join(failures)


def assert_serves(report: check.Report, what: str):
    text = check.format_report(report, what)
    print(text)
    assert report.compiles and report.fits, text
    copies = {r.name: r.whole_pool_copies for r in report.results if r.whole_pool_copies}
    assert not copies, f"{what}: whole-pool copies {copies}\n{text}"


def test_embedded_model_default_config_compiles():
    """configs/tiny-cpu.yaml, decode_steps 8, on v6e-1 (bf16, Pallas kernels, the pool sized from
    one chip's HBM, head_dim 32 in 128 lanes; before the lane padding each step had 24-48 whole-
    pool copies and did not fit): its largest decode step and its 8-step loop (the sampler inside;
    plain, and with penalties and a bias), its largest prefill step, the sampler's 4 variants for
    the most logit rows (SparseCore scatters on v6e), the page copy. Not here (suite time): decode-8,
    the largest's program over fewer rows (tiny's compiles on v5e in the draft test below); all
    14 step shapes, their loops, every sampler row count: `jaxserve check`."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), decode_steps=8)
    largest, smallest, prefill = check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False))
    assert largest.plain_decode and largest.decode_rows == ecfg.max_num_seqs > smallest.decode_rows
    rows = max(s.logit_rows for s in (largest, prefill))
    report = check.check(ecfg, ModelConfig.from_pretrained(TINY), check.tpu_slice("v6e-1"), model_name="tiny",
                         dtype=jnp.bfloat16, shapes=[largest, prefill], sampler_rows=[rows])
    assert [r.name for r in report.results] == [largest.name, prefill.name] + [
        f"{largest.name}-x8{v}" for v in ("", "-penalties-bias")] + [
        f"sampler-{rows}{v}" for v in ("", "-penalties-bias", "-mask", "-penalties-bias-mask")] + ["page-copy"]
    assert_serves(report, "tiny on v6e-1, decode_steps 8")


def test_quantized_moe_step_compiles():
    """A small Qwen3-MoE with int4 experts on v6e-1 (jaxserve/models/experts.py: a loop over chunks
    of experts dequantized into the grouped ragged_dot): the smallest decode step compiles and
    fits, no whole-pool copies."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), quantization="int4")
    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1024, hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, max_position_embeddings=2048))
    shapes = check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False))[1:2]
    report = check.check(ecfg, cfg, check.tpu_slice("v6e-1"), model_name="qwen3-moe-int4", dtype=jnp.bfloat16,
                         shapes=shapes, samplers=False)
    assert_serves(report, "a small Qwen3-MoE, int4 experts, on v6e-1")


def test_check_takes_a_checkpoints_own_quantization(tmp_path, capsys):
    """`jaxserve check` of a gpt-oss config.json whose quantization_config is MXFP4 (a checkpoint's
    mode, which no --quantization names): its experts sized and compiled as stored, 4.25 bits a
    weight, on v6e-1."""
    model = tmp_path / "gpt-oss-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=512, hidden_size=64,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=4096, torch_dtype="bfloat16",
        quantization_config={"quant_method": "mxfp4"})))
    (tmp_path / "engine.yaml").write_text(yaml.safe_dump(dict(
        model=str(model), dtype="bfloat16", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
        prefill_chunk_size=128, max_prefill_seqs=1)))
    assert check.run(str(tmp_path / "engine.yaml"), "v6e-1", quick=True) == 0
    assert "bfloat16, mxfp4 weights" in capsys.readouterr().out
    cfg = ModelConfig.from_pretrained(str(model))
    assert sizing.weight_bytes_per_chip(cfg, jnp.bfloat16, 1, "mxfp4") < sizing.weight_bytes_per_chip(
        cfg, jnp.bfloat16, 1, None)


def test_check_sizes_and_compiles_a_draft_model():
    """The embedded model drafted by its draft checkpoint (speculative method draft) on v5e-1, as
    the engine sizes it (sizing.kv_pool_pages with the draft: fewer pages than alone): the
    draft's weights and its own pool of as many pages reported and counted in the total, and
    the draft runner's step shapes compiled beside the target's (its own buckets, no proposals:
    the draft's quick shapes, here all 2 of them), named draft-... (tiny's decode-8 for v5e)."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), model=TINY, max_num_seqs=8,
                                  speculative={"method": "draft", "num_tokens": 4})
    cfg = ModelConfig.from_pretrained(TINY)
    drafted = check.draft_of(ecfg, cfg)
    draft = drafted.cfg
    tpu = check.tpu_slice("v5e-1")
    shapes = [s for s in Buckets(ecfg, platform="tpu").warmup_shapes(False) if s.name == "decode-8"]
    report = check.check(ecfg, cfg, tpu, model_name="tiny", dtype=jnp.bfloat16, shapes=shapes, samplers=False,
                         draft=drafted)
    assert_serves(report, "tiny drafted by tiny/draft on v5e-1")
    weights = sizing.weight_bytes_per_chip(cfg, jnp.bfloat16, 1)
    size = functools.partial(sizing.kv_pool_pages, cfg, ecfg, jnp.bfloat16, model_axis=1, hbm_bytes=tpu.hbm_bytes,
                             used_bytes=weights, tpu=True, chip="v5e", name="tiny")
    assert report.num_pages == size(draft=drafted) < size()
    page, draft_page = (check.page_bytes_per_chip(c, jnp.bfloat16, ecfg.page_size, 1, tpu=True) for c in (cfg, draft))
    assert report.kv_bytes == report.num_pages * (page + draft_page)
    assert report.draft_kv_bytes == report.num_pages * draft_page
    assert report.weight_bytes == weights
    assert report.draft_weight_bytes == sizing.weight_bytes_per_chip(draft, jnp.bfloat16, 1) > 0
    assert [r.name for r in report.results] == ["decode-8", "page-copy", "draft-decode-8",
                                                "draft-prefill-128x2q128", "draft-page-copy"]
    assert "GiB draft)" in check.format_report(report, "tiny")


# One chip and TP 8, as in the shipped configs/llama3-8b-v6e-1 and -v5e-8 (v6e-4 and the rest:
# `jaxserve check`, minutes each). v6e compiles one computation at a time (check._SPARSECORE),
# and the prefill step took 56 of its 75 s: there, the largest decode step only. Not here (suite
# time): decode-8, the largest's program over fewer rows, pool sharded alike, the kernels' q
# blocks the same (pallas_kernels/paged_attention/tpu.py: block_q does not depend on the rows).
LLAMA3_8B_TARGETS = [("v6e-1", 1, ["decode-64"]),
                     ("v5e-8", 8, ["decode-64", "prefill-512x2q512"])]
CI_LAYERS = 2   # of Llama-3-8B's 32: every layer compiles to the same ops, and 2 compile 16x faster


def with_ci_layers(full: ModelConfig, ecfg: EngineConfig, tpu: check.Slice, tp: int, name: str) -> ModelConfig:
    """`full` cut to CI_LAYERS layers, with ecfg's KV pool sized (in place) for all its layers."""
    ecfg.num_pages = sizing.kv_pool_pages(full, ecfg, jnp.bfloat16, model_axis=tp, hbm_bytes=tpu.hbm_bytes,
                                          used_bytes=sizing.weight_bytes_per_chip(full, jnp.bfloat16, tp),
                                          tpu=tpu.devices[0].platform == "tpu", chip=tpu.generation, name=name)
    return dataclasses.replace(full, num_layers=CI_LAYERS, sliding_windows=())


@pytest.mark.parametrize("topology, tp, names", LLAMA3_8B_TARGETS)
def test_llama3_8b_steps_compile_without_whole_pool_copies(topology, tp, names):
    """decode-64 (one chip; and TP 8 with the largest prefill bucket) of Llama-3-8B bf16
    with the KV pool the runner would size for all 32 layers, compiled with CI_LAYERS of them
    (every bucket and every layer: `jaxserve check`, see the README)."""
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "llama3-8b-v5e-8.yaml"), mesh={"model": tp})
    tpu = check.tpu_slice(topology)
    cfg = with_ci_layers(ModelConfig.from_pretrained(LLAMA3_8B), ecfg, tpu, tp, "llama3-8b")
    shapes = check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False))
    assert [s.name for s in shapes] == ["decode-64", "decode-8", "prefill-512x2q512"]
    shapes = [s for s in shapes if s.name in names]
    report = check.check(ecfg, cfg, tpu, model_name="llama3-8b", dtype=jnp.bfloat16, shapes=shapes, samplers=False)
    assert_serves(report, f"llama3-8b ({CI_LAYERS} layers) on {topology}")
    # The weights per chip as jax shards them: every leaf's shard, summed.
    params = param_shapes(cfg, jnp.bfloat16)
    shardings = parallel.param_shardings(params, parallel.make_mesh({"model": tp}, tpu.devices[:tp]), cfg)
    shards = jax.tree.leaves(jax.tree.map(lambda s, sh: np.prod(sh.shard_shape(s.shape)) * s.dtype.itemsize,
                                          params, shardings))
    assert report.weight_bytes == sum(shards)
    assert report.results[0].name == "decode-64" and report.results[0].temp_bytes < 64 * 2**20, report.results[0]


# BLOOM-560m's config.json (ALiBi: 16 heads of 64, stored in 128 lanes on TPU; vocab 250880).
BLOOM_560M = dict(architectures=["BloomForCausalLM"], model_type="bloom", hidden_size=1024, n_head=16, n_layer=24,
                  vocab_size=250880, layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2)


# TP 4 only (suite time): the per-chip slopes are what one chip would not show; the kernels
# with slopes compile for every generation in the kernel grid above.
@pytest.mark.parametrize("topology, tp", [("v6e-4", 4)])
def test_bloom_alibi_steps_compile(topology, tp, monkeypatch):
    """An ALiBi family's engine step through the Pallas TPU kernels: the slopes reach the paged
    kernel (decode) and the flash and paged kernels (prefill step), each chip's kernels with
    its own heads' (16 / tp). configs/tiny-cpu.yaml's largest decode and prefill steps (its
    smallest decode step is the largest's program over fewer rows, pool sharded alike)."""
    slopes_seen = set()   # (kernel, slopes shape) as traced

    def recording(name, kernel):
        def call(*args, alibi_slopes=None, **kwargs):
            slopes_seen.add((name, None if alibi_slopes is None else alibi_slopes.shape))
            return kernel(*args, alibi_slopes=alibi_slopes, **kwargs)
        return call
    monkeypatch.setattr(paged_tpu, "ragged_paged_attention", recording("paged", ragged_paged_attention))
    monkeypatch.setattr(flash_tpu, "flash_attention", recording("flash", flash_attention))
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "tiny-cpu.yaml"), mesh={"model": tp})
    tpu = check.tpu_slice(topology)
    cfg = with_ci_layers(ModelConfig.from_hf_dict(BLOOM_560M), ecfg, tpu, tp, "bloom-560m")
    shapes = check.quick_shapes(Buckets(ecfg, platform="tpu").warmup_shapes(False))[::2]   # not decode-8
    report = check.check(ecfg, cfg, tpu, model_name="bloom-560m", dtype=jnp.bfloat16, shapes=shapes, samplers=False)
    assert len(report.results) == len(shapes) + 1   # the steps, the page copy
    assert_serves(report, f"bloom-560m ({CI_LAYERS} layers) on {topology}")
    assert slopes_seen == {("paged", (16 // tp,)), ("flash", (16 // tp,))}, slopes_seen


def test_llama3_8b_on_one_v5e_chip_is_refused(capsys):
    """15 GiB of weights on a 15.75 GiB chip: `jaxserve check` refuses it and says what fits."""
    code = cli.main(["check", "--config", os.path.join(ROOT, "configs", "llama3-8b-v6e-1.yaml"),
                     "--topology", "v5e-1", "--model", LLAMA3_8B])
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT: llama3-8b bfloat16 needs at least 2 v5e chips: set mesh model: 2" in out, out
    # ... and 2 chips do fit (the sizing the refusal relied on)
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "llama3-8b-v6e-1.yaml"))
    cfg = ModelConfig.from_pretrained(LLAMA3_8B)
    pages = sizing.kv_pool_pages(cfg, ecfg, jnp.bfloat16, model_axis=2, hbm_bytes=int(15.75 * 2**30),
                                 used_bytes=sizing.weight_bytes_per_chip(cfg, jnp.bfloat16, 2), tpu=True, chip="v5e",
                                 name="llama3-8b")
    assert pages >= sizing.pages_per_seq(cfg, ecfg)


def test_step_cost_counts_whole_pool_copies():
    """The counter behind the zero-copies assertions: an in-place page write is no copy; a
    flat view of a [pages, heads, slots, dim] pool gathered by page (a relayout: the slots
    dim is tiled) is one per pool; a looped body's estimated cycles are read; conditionals
    are counted."""
    dev = device("v5e")
    pool = abstract((512, 8, 16, 128), jnp.bfloat16, dev)
    pool_bytes = 512 * 8 * 16 * 128 * 2
    page = abstract((4,), jnp.int32, dev)

    def write(pool, page):
        return pool.at[page, :, 3].set(1.0)

    def flat_gather(pool, page):
        return jax.lax.fori_loop(0, page[0], lambda i, acc: acc + pool.reshape(512, -1)[page + i].sum(), 0.0)

    def cost(f, **jit):
        return check.step_cost(jax.jit(f, **jit).lower(pool, page).compile().as_text(), pool_bytes)

    written = cost(write, donate_argnums=0)
    assert written.whole_pool_copies == written.conditionals == 0
    assert cost(lambda pool, page: jax.lax.cond(page[0] > 0, write, lambda *_: pool, pool, page)).conditionals == 1
    gathered = cost(flat_gather)
    assert gathered.whole_pool_copies >= 1, gathered
    assert gathered.heaviest_loop_cycles > 0


def test_step_cost_counts_only_the_new_buffer_of_async_starts():
    """Memory-space assignment's sliced move of a pool into another memory space (seen on
    Llama-3-70B at v6e-8): the slices are no pool copies (their result tuples also name the
    whole operand); the joined buffer and the copy back are."""
    hlo = "\n".join([
        "ENTRY %main (p: bf16[64,8]) -> bf16[64,8] {",
        "  %p = bf16[64,8]{1,0} parameter(0)",
        "  %slice-start = ((bf16[64,8]{1,0}), bf16[16,8]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:16], [0:8]}",
        "  %slice-done = bf16[16,8]{1,0:S(1)} slice-done(%slice-start)",
        '  %join = bf16[64,8]{1,0:S(1)} custom-call(%slice-done), custom_call_target="ConcatBitcast"',
        "  %copy-start = (bf16[64,8]{1,0}, bf16[64,8]{1,0:S(1)}, u32[]{:S(2)}) copy-start(%join)",
        "  ROOT %copy-done = bf16[64,8]{1,0} copy-done(%copy-start)",
        "}"])
    assert check.step_cost(hlo, 64 * 8 * 2).copies == ("custom-call join", "copy-start copy-start")


def test_step_cost_counts_no_broadcast_as_a_pool_copy():
    """XLA:TPU broadcasts an fp8 weight's grouped scales to the weight's shape in VMEM (the
    instruction below is from one [12288, 4096] Linear compiled for v5e): 96 MiB, a Qwen3-8B K
    pool's size on one v5e, but made from 0.4 MiB of scales, not a pass over a pool. A copy of
    the same size still counts."""
    hlo = "\n".join([
        "ENTRY %main (s: bf16[12288,32]) -> bf16[12288,32,128] {",
        "  %s = bf16[12288,32]{1,0} parameter(0)",
        "  %broadcast = bf16[12288,32,128]{2,1,0:T(8,128)(2,1)S(1)} broadcast(%s), dimensions={0,1}",
        "  ROOT %copy = bf16[12288,32,128]{1,2,0:T(8,128)(2,1)} copy(%broadcast)",
        "}"])
    assert check.step_cost(hlo, 12288 * 4096 * 2).copies == ("copy copy",)
