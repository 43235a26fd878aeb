"""`jaxserve check`: will this engine config serve on that TPU slice, or on those H100s? Answered
on any machine with the compilers installed (libtpu: `pip install jaxserve[tpu]`; for GPUs the CUDA
plugin and ptxas, as the Makefile installs them), no TPU, no GPU and no weights needed.

The model is built from its config.json alone (ShapeDtypeStructs for the weights and KV pools,
sharded as parallel.py shards them) on compile-only devices of the slice
(`jax.experimental.topologies`; GPUs from the H100 SXM target description in assets/targets).
Every computation warm-up would compile (the step for every bucket, the sampler, the page copy,
sequence-parallel prefills) goes through XLA:TPU and Mosaic TPU, or XLA:GPU, Mosaic GPU and
ptxas. Per chip it reports the weights, the KV pool the runner would size, the step
temporaries, whether that fits in HBM, and what each step costs (step_cost.py).
With a draft model (speculative method draft) it sizes the pool as the engine does, with room for
the draft's weights and its own pool, and compiles the draft runner's warm-up too ("draft-...").
Exit status 1 when it does not fit or does not compile.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import pathlib
import re
import time
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import parallel, sizing
from jaxserve.attention import resolve_backend
from jaxserve.buckets import Buckets, StepShape
from jaxserve.checkpoint import param_shapes, saved_lm_head, saved_quantization
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.kv_cache import KVCache, page_bytes_per_chip
from jaxserve.kv_groups import KVGroups, kv_groups
from jaxserve.models import build_model
from jaxserve.executables import lower
from jaxserve.step import (empty_sequence_parallel_prefill, last_sampled_spec, lower_step, make_multi_step, make_step,
                           multi_step_arrays, multi_step_variants, page_copy_batches, sampler_lowerings, table_groups)
from jaxserve.sequence_parallel import sequence_parallel_prefill
from jaxserve.spec_decode.draft import DraftModel, draft_model
from jaxserve.step_cost import step_cost

log = logging.getLogger(__name__)
GiB, MiB = 2**30, 2**20
# libtpu topology names by chip count: v5e/v6e slices are 2D, v4/v5p 3D. A slice smaller than
# one host's 2x2 chips takes the first chips of a 2x2.
_TOPOLOGY_2D = {1: "2x2", 2: "2x2", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_TOPOLOGY_3D = {1: "2x2x1", 2: "2x2x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
# Cloud TPU names count TensorCores for v5p (two per chip: v5p-8 is 4 chips), chips for v5e and v6e.
_CORES_PER_CHIP = {"v5p": 2, "v5e": 1, "v6e": 1}
H100_TARGET = pathlib.Path(__file__).parent / "assets" / "targets" / "h100_sxm.txtpb"
# Chips whose compiler offloads scatters to their SparseCores (the sampler's penalties do): libtpu
# 0.0.42's SparseCore code generator crashes the process (SIGSEGV) when another compilation runs
# beside it (2 threads: most runs), so for these one computation compiles at a time.
_SPARSECORE = ("v5p", "v6e")


class Slice(NamedTuple):
    name: str          # as Cloud TPU names it, e.g. v5e-8
    generation: str
    chips: int
    devices: list      # compile-only devices, one per chip
    hbm_bytes: int     # per chip


def tpu_slice(name: str) -> Slice:
    m = re.fullmatch(r"(v5e|v5p|v6e)-(\d+)", name)
    if m is None:   # (libtpu's compile-only v4 devices are TensorCores, not megacore chips)
        raise ValueError(f"unknown TPU slice {name!r}: expected e.g. v5e-8, v6e-4, v6e-1, v5p-8")
    generation = m.group(1)
    chips = max(int(m.group(2)) // _CORES_PER_CHIP[generation], 1)
    shapes = _TOPOLOGY_3D if generation == "v5p" else _TOPOLOGY_2D
    if chips not in shapes:
        raise ValueError(f"{name}: {chips} chips is not a slice size this check knows ({sorted(shapes)})")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name=f"{generation}:{shapes[chips]}")
    return Slice(name, generation, chips, list(topology.devices[:chips]), int(sizing.TPU_HBM_GIB[generation] * GiB))


def gpu_slice(name: str) -> Slice:
    """h100 or h100-N (N GPUs of one host, 1 to 8). A GPU's usable memory is what JAX's client
    takes of the card: XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 unless set), as the runner
    sees it in `bytes_limit`."""
    m = re.fullmatch(r"h100(?:-(\d+))?", name)
    gpus = int(m.group(1) or 1) if m else 0
    if not 1 <= gpus <= 8:
        raise ValueError(f"unknown GPU topology {name!r}: expected h100 or h100-N, N up to 8")
    from jax.experimental import topologies

    target = H100_TARGET.read_text()
    topology = topologies.get_topology_desc(platform="cuda", topology=f"1x1x{gpus}", target_config=target)
    card = int(re.search(r"device_memory_size: (\d+)", target).group(1))
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    return Slice(name, "h100", gpus, list(topology.devices), int(card * fraction))


def target_slice(name: str) -> Slice:
    return gpu_slice(name) if name.startswith("h100") else tpu_slice(name)


class Compiled(NamedTuple):
    name: str
    seconds: float
    temp_bytes: int
    whole_pool_copies: int
    heaviest_loop_cycles: int
    conditionals: int       # a host round trip each on a GPU (step_cost.py)
    sliced_kernel_operands: int   # refused by Mosaic GPU at run time when not 256-byte aligned
    error: str | None


class Report(NamedTuple):
    weight_bytes: int      # the target's (a draft model's: draft_weight_bytes)
    num_pages: int         # of each pool (the target's, and a draft model's own)
    kv_bytes: int          # every pool's, draft_kv_bytes of them the draft model's
    hbm_bytes: int
    results: list[Compiled]
    refusal: str | None    # why the KV pool could not be sized (nothing compiled then)
    # Tokens of max_model_len sequences the pool holds, and would hold without the hybrid cache
    # (jaxserve/kv_groups.py; equal for a model without sliding layers).
    capacity: tuple[int, int] = (0, 0)
    draft_weight_bytes: int = 0   # a draft model's (speculative method draft; 0: none)
    draft_kv_bytes: int = 0

    @property
    def all_weight_bytes(self) -> int:
        return self.weight_bytes + self.draft_weight_bytes

    @property
    def peak_temp_bytes(self) -> int:
        return max((r.temp_bytes for r in self.results), default=0)

    @property
    def fits(self) -> bool:
        return self.refusal is None and self.all_weight_bytes + self.kv_bytes + self.peak_temp_bytes <= self.hbm_bytes

    @property
    def compiles(self) -> bool:
        return self.refusal is None and all(r.error is None for r in self.results)


def _compile(name: str, lowered, pool_bytes: int) -> Compiled:
    t0 = time.perf_counter()
    try:
        compiled = lowered().compile()
    except Exception as e:  # a compiler's refusal is this check's answer, reported per computation
        log.info("%s does not compile", name)
        return Compiled(name, time.perf_counter() - t0, 0, 0, 0, 0, 0, str(e).strip().splitlines()[0][:300])
    seconds = time.perf_counter() - t0
    cost, temp = step_cost(compiled.as_text(), pool_bytes), compiled.memory_analysis().temp_size_in_bytes
    # each result as it comes: a long check stopped part way still says what it found
    log.info("compiled %s in %.1f s: temporaries %.1f MiB, %d whole-pool copies, heaviest loop body %d cycles, "
             "%d conditionals, %d sliced kernel operands", name, seconds, temp / MiB, cost.whole_pool_copies,
             cost.heaviest_loop_cycles, cost.conditionals, cost.sliced_kernel_operands)
    return Compiled(name, seconds, temp, cost.whole_pool_copies, cost.heaviest_loop_cycles, cost.conditionals,
                    cost.sliced_kernel_operands, None)


def pool_bytes_per_chip(kv: KVCache) -> int:
    """One layer's K (or V) pool on one chip as HLO shapes count it: head_dim padded to the TPU's
    128 lanes (pool_head_dim), without the tiles' padding of the slots, without the scales. (Sized
    from the model's head_dim, copies of a head_dim 32 pool, 4x that, went uncounted.)"""
    pool = kv.layers[0].k
    return math.prod(pool.sharding.shard_shape(pool.shape)) * pool.dtype.itemsize


def quick_shapes(shapes: list[StepShape]) -> list[StepShape]:
    """The largest and smallest decode steps and the largest step with prefill (`--quick`)."""
    decode = [s for s in shapes if not s.prefill_rows]
    return [decode[-1], decode[0]] + [s for s in shapes if s.prefill_rows][-1:]


def draft_of(ecfg: EngineConfig, cfg: ModelConfig) -> DraftModel | None:
    """The engine config's draft model (speculative method draft) for the model of `cfg`, as the
    engine reads it (spec_decode/draft.py), or None."""
    return draft_model(ecfg, ecfg.model or TINY_MODEL_DIR, cfg, TINY_MODEL_DIR)


def check(ecfg: EngineConfig, cfg: ModelConfig, target: Slice, *, model_name: str, dtype=jnp.bfloat16,
          backend: str | None = None, shapes: list[StepShape] | None = None, samplers: bool = True,
          sampler_rows: list[int] | None = None, quantization: str | None = None,
          draft: DraftModel | None = None) -> Report:
    """Size the KV pool as the runner would on `target` and compile what warm-up compiles (or, for
    a quicker look, only `shapes` of the step and, with `samplers`, the sampler variants of
    their logit rows, or of `sampler_rows` only). `quantization`: how the weights are held (None:
    as ecfg says; a checkpoint's own mode, such as gpt-oss's mxfp4, is no engine config's).
    With a `draft` model (draft_of: speculative method draft) the pool makes room for the draft's weights and
    its own pool of as many pages (sizing.kv_pool_pages), and what the draft's runner warms up
    compiles too, named "draft-...": every shape of its own buckets, or the quick_shapes of them
    when `shapes` is given, and, with `samplers`, the sampler variants of their logit rows."""
    quantization = quantization or ecfg.quantization
    sizes = {"data": 1, "seq": 1, "model": 1, **ecfg.mesh}
    if np.prod(list(sizes.values())) > target.chips:
        raise ValueError(f"mesh {sizes} needs more than the {target.chips} chips of {target.name}")
    # Data-parallel replicas are independent engines: one replica's mesh is the one to check.
    mesh = parallel.make_mesh({**sizes, "data": 1}, target.devices[:sizes["seq"] * sizes["model"]])
    model_axis, tpu = mesh.shape["model"], parallel.platform(mesh) == "tpu"
    groups = kv_groups(cfg, ecfg)
    weight_bytes = sizing.weight_bytes_per_chip(cfg, dtype, model_axis, quantization, ecfg.quantize_lm_head)
    draft_weight_bytes = draft_kv_bytes = 0
    if draft is not None:   # held as the draft proposer loads it
        draft_weight_bytes = sizing.weight_bytes_per_chip(draft.cfg, dtype, model_axis, draft.quantization,
                                                          draft.quantize_lm_head)
    try:
        num_pages = ecfg.num_pages or sizing.kv_pool_pages(cfg, ecfg, dtype, model_axis=model_axis,
                                                           hbm_bytes=target.hbm_bytes, used_bytes=weight_bytes,
                                                           tpu=tpu, chip=target.generation, name=model_name,
                                                           quantization=quantization, groups=groups,
                                                           draft=draft)
    except sizing.PoolDoesNotFit as e:
        return Report(weight_bytes, 0, 0, target.hbm_bytes, [], str(e), draft_weight_bytes=draft_weight_bytes)
    page_bytes = page_bytes_per_chip(cfg, dtype, ecfg.page_size, model_axis, tpu=tpu, kv_cache_dtype=ecfg.kv_cache_dtype,
                                     groups=groups)
    plain = KVGroups.of(cfg.sliding_windows, enabled=False)
    plain_pages = num_pages * page_bytes // page_bytes_per_chip(cfg, dtype, ecfg.page_size, model_axis, tpu=tpu,
                                                                kv_cache_dtype=ecfg.kv_cache_dtype, groups=plain)
    capacity = (sizing.context_tokens(cfg, ecfg, groups, num_pages), sizing.context_tokens(cfg, ecfg, plain, plain_pages))
    work = _lowerings(ecfg, cfg, mesh, num_pages, dtype, quantization, backend, shapes, samplers, sampler_rows)
    if draft is not None:   # the draft runner's engine config, as DraftProposer makes it
        draft_ecfg = draft.engine_config(ecfg, num_pages, ecfg.max_model_len or cfg.max_position_embeddings)
        draft_kv_bytes = num_pages * page_bytes_per_chip(draft.cfg, dtype, ecfg.page_size, model_axis, tpu=tpu,
                                                         kv_cache_dtype=ecfg.kv_cache_dtype)
        work += _lowerings(draft_ecfg, draft.cfg, mesh, num_pages, dtype, draft.quantization, backend, None,
                           samplers, None, quick=shapes is not None, prefix="draft-")
    workers = 1 if target.generation in _SPARSECORE else os.cpu_count()
    with concurrent.futures.ThreadPoolExecutor(workers) as executor:   # XLA compiles without the GIL
        results = list(executor.map(lambda w: _compile(*w), work))
    return Report(weight_bytes, num_pages, num_pages * page_bytes + draft_kv_bytes, target.hbm_bytes, results, None,
                  capacity, draft_weight_bytes, draft_kv_bytes)


def _lowerings(ecfg: EngineConfig, cfg: ModelConfig, mesh, num_pages: int, dtype, quantization: str | None,
               backend: str | None, shapes: list[StepShape] | None, samplers: bool, sampler_rows: list[int] | None,
               quick: bool = False, prefix: str = "") -> list[tuple[str, Callable, int]]:
    """(name, lowering, one layer's pool bytes) of each computation the warm-up of a runner of
    `cfg` under `ecfg` compiles, with a pool of num_pages pages (see `check`; `quick`: the
    quick_shapes of its own when no `shapes`), each name after `prefix`."""
    groups = kv_groups(cfg, ecfg)
    unsharded = param_shapes(cfg, dtype, quantization, ecfg.quantize_lm_head)
    params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                          unsharded, parallel.param_shardings(unsharded, mesh, cfg))
    kv = KVCache.spec(cfg, mesh, num_pages, ecfg.page_size, dtype, ecfg.kv_cache_dtype, groups)
    model = build_model(cfg, dtype)
    backend = resolve_backend(backend or ecfg.attention_backend, parallel.platform(mesh), cfg.head_dim,
                              ecfg.kv_cache_dtype)
    step = make_step(model, cfg, mesh, backend)
    max_pages = sizing.pages_per_seq(cfg, ecfg)
    buckets = Buckets(ecfg, mesh.shape["seq"], parallel.platform(mesh), backend)
    if shapes is None:
        shapes = buckets.warmup_shapes(mesh.shape["seq"] > 1)
        shapes = list(dict.fromkeys(quick_shapes(shapes))) if quick else shapes   # one decode bucket: once

    last_sampled = last_sampled_spec(mesh, buckets.max_logit_rows)
    work = [(s.name, lambda s=s: lower_step(step, params, kv, s, max_pages, num_pages * ecfg.page_size, last_sampled))
            for s in shapes]
    if ecfg.decode_steps > 1:
        multi = make_multi_step(model, cfg, mesh, backend, buckets.max_logit_rows)
        max_len = ecfg.max_model_len or cfg.max_position_embeddings
        work += [(f"{s.name}-x{ecfg.decode_steps}{'-penalties-bias' if p else ''}{'-filters' if f else ''}",
                  lambda s=s, p=p, f=f: lower(
                      multi, params, kv, *multi_step_arrays(
                          s, max_pages, num_pages * ecfg.page_size, last_sampled,
                          last_sampled_spec(mesh, ecfg.decode_steps, buckets.max_logit_rows), max_len, cfg.vocab_size, p,
                          groups=table_groups(kv)),
                      steps=ecfg.decode_steps, filters=f))
                 for s in shapes if s.plain_decode
                 for p, f in multi_step_variants(parallel.platform(mesh))]
    if samplers:
        work += sampler_lowerings(sampler_rows or [s.logit_rows for s in shapes], cfg.vocab_size, mesh,
                                  ecfg.max_model_len or cfg.max_position_embeddings, buckets.max_logit_rows)
    if mesh.shape["seq"] > 1:
        work += [(f"sequence-parallel-prefill-{t}", lambda t=t: sequence_parallel_prefill.lower(
            model, mesh, params, kv, *empty_sequence_parallel_prefill(t, max_pages, table_groups(kv)), backend=backend))
            for t in buckets.tokens]
    src, dst = next(page_copy_batches([(0, 0)], ecfg.max_num_seqs, num_pages))
    work.append(("page-copy", lambda: KVCache.copy_pages.lower(kv, src, dst)))
    pool_bytes = pool_bytes_per_chip(kv)
    return [(prefix + name, lowered, pool_bytes) for name, lowered in work]


def format_report(report: Report, header: str) -> str:
    # with a draft model: the target's and the draft's weights, and both pools (as many pages each)
    weights = f"  weights            {report.all_weight_bytes / GiB:8.2f} GiB" + (
        f"  ({report.weight_bytes / GiB:.2f} GiB target + {report.draft_weight_bytes / GiB:.2f} GiB draft)"
        if report.draft_weight_bytes else "")
    lines = [header]
    if report.refusal:
        return "\n".join(lines + [weights, f"DOES NOT FIT: {report.refusal}"])
    peak = max(report.results, key=lambda r: r.temp_bytes)
    total = report.all_weight_bytes + report.kv_bytes + report.peak_temp_bytes
    lines += [
        weights,
        f"  KV pool            {report.kv_bytes / GiB:8.2f} GiB  ({report.num_pages} pages" + (
            f"; the draft's own pool of as many: {report.draft_kv_bytes / GiB:.2f} GiB)" if report.draft_kv_bytes
            else ")"),
        f"  KV capacity        {report.capacity[0]:8,d} tokens of full-length sequences" + (
            "" if report.capacity[0] == report.capacity[1] else f" ({report.capacity[1]:,d} without the hybrid KV cache"
            + (f": {report.capacity[0] / report.capacity[1]:.2f}x)" if report.capacity[1] else ")")),
        f"  peak temporaries   {report.peak_temp_bytes / GiB:8.2f} GiB  ({peak.name})",
        f"  total              {total / GiB:8.2f} GiB of {report.hbm_bytes / GiB:.2f} GiB HBM: "
        f"{'fits' if report.fits else 'DOES NOT FIT'}",
        f"  compiled           {len(report.results)} computations in "
        f"{sum(r.seconds for r in report.results):.1f} s of compiler time",
        f"  {'computation':30} {'temporaries':>12} {'whole-pool copies':>18} {'heaviest loop body':>19} {'compile':>8}",
    ]
    for r in report.results:
        if r.error:
            lines.append(f"  {r.name:30} DOES NOT COMPILE: {r.error}")
        else:
            cycles = f"{r.heaviest_loop_cycles:12,d} cycles" if r.heaviest_loop_cycles else f"{'-':>19}"  # TPU only
            lines.append(f"  {r.name:30} {r.temp_bytes / MiB:8.1f} MiB {r.whole_pool_copies:18d} {cycles} {r.seconds:7.1f}s")
    ok = report.fits and report.compiles
    lines.append("OK: compiles and fits" if ok else
                 "FAILED: " + ", ".join(w for w, bad in (("does not compile", not report.compiles),
                                                         ("does not fit", not report.fits)) if bad))
    return "\n".join(lines)


def run(config: str, topology: str, model: str | None = None, backend: str | None = None,
        quick: bool = False, quantization: str | None = None, quantize_lm_head: bool = False) -> int:
    """`jaxserve check` (check_cli.py): print the report; 0 when it compiles and fits, else 1."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    ecfg = EngineConfig.from_yaml(config, model=model, quantization=quantization,
                                  quantize_lm_head=quantize_lm_head or None)
    if ecfg.model is None:
        raise SystemExit("jaxserve check: the config names no model directory (give --model)")
    cfg = dataclasses.replace(ModelConfig.from_pretrained(ecfg.model), expert_parallel=ecfg.enable_expert_parallel)
    try:
        draft = draft_of(ecfg, cfg)
    except (OSError, ValueError) as e:   # no config.json where the draft should be, no draft named,
        # or another vocabulary
        raise SystemExit(f"jaxserve check: the draft model (speculative method draft): {e}")
    # a checkpoint stored quantized is served so, as the engine does (the draft's: draft_of)
    quantization = ecfg.quantization or saved_quantization(ecfg.model)
    ecfg = dataclasses.replace(ecfg, quantize_lm_head=ecfg.quantize_lm_head or saved_lm_head(ecfg.model))
    dtype = jnp.float32 if ecfg.dtype == "float32" else jnp.bfloat16   # auto: bf16 on TPU and GPU
    target = target_slice(topology)
    name = os.path.basename(os.path.normpath(ecfg.model))
    seq = ecfg.mesh.get("seq", 1)
    platform = target.devices[0].platform
    buckets = Buckets(ecfg, seq, platform, resolve_backend(backend or ecfg.attention_backend, platform, cfg.head_dim,
                                                           ecfg.kv_cache_dtype))
    shapes = list(dict.fromkeys(quick_shapes(buckets.warmup_shapes(seq > 1))))   # one decode bucket: once
    report = check(ecfg, cfg, target, model_name=name, dtype=dtype, backend=backend,
                   shapes=shapes if quick else None, samplers=not quick, quantization=quantization, draft=draft)
    weights = jnp.dtype(dtype).name + (f", {quantization} weights" if quantization else "") + (
        " and LM head" if ecfg.quantize_lm_head else "")
    quick_note = f", quick: {len(shapes)} step shapes{' each' if draft else ''}, no sampler" if quick else ""
    header = (f"jaxserve check: {name} ({cfg.num_params / 1e9:.2f}B parameters, {weights}) "
              + (f"drafted by {draft.dir} ({draft.cfg.num_params / 1e9:.2f}B parameters) " if draft else "")
              + f"with {config} on {target.name} ({target.chips} chip(s)), mesh {ecfg.mesh}"
              f"{quick_note}, per chip:")
    print(format_report(report, header))
    return 0 if report.fits and report.compiles else 1
