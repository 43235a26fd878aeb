"""Attention kernel benchmark: our Pallas kernels vs the XLA reference vs the kernels that ship
with JAX, on this machine's default device.

  prefill  flash attention, causal, batch 1, over sequence lengths          -> TFLOP/s
  decode   ragged paged attention, one token per sequence, over batch size,
           context length and page size                                     -> GB/s of K/V read
  mixed    prefill chunks and decodes in one ragged batch                   -> both
  kv write the XLA scatter of new K/V into the page pool (jaxserve.kv_cache.LayerKV.write)

Each figure stands beside the chip's datasheet peak. On CPU only the XLA path runs (no Pallas
without interpret mode, which times nothing useful). Writes benchmarks/results/kernels_<device>.md.

  python benchmarks/kernels.py [--quick]
"""
import argparse
import datetime
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # run as a script: find benchmarks/
from benchmarks.common import RESULTS_DIR, gpu_busy_ms, markdown_table, profile_gpu, write_keeping_notes  # noqa: E402
from jaxserve.kv_cache import LayerKV  # noqa: E402
from pallas_kernels.flash_attention.reference import causal_attention  # noqa: E402
from pallas_kernels.paged_attention.reference import ragged_paged_attention_xla  # noqa: E402

# Datasheet peaks: dense bf16 TFLOP/s, HBM GB/s. Matched against jax's device_kind.
PEAKS = {
    "H200": ("h200", 989, 4800),
    "H100": ("h100", 989, 3350),  # SXM; PCIe is 756 / 2000
    "TPU v5 lite": ("tpu-v5e", 197, 819),
    "TPU v5e": ("tpu-v5e", 197, 819),
    "TPU v6 lite": ("tpu-v6e", 918, 1640),
    "TPU v6e": ("tpu-v6e", 918, 1640),
}


def device_info():
    """(file slug, device kind, peak TFLOP/s or None, peak GB/s or None)."""
    kind = jax.devices()[0].device_kind
    for key, (slug, tflops, gbs) in PEAKS.items():
        if key in kind:
            return slug, kind, tflops, gbs
    return kind.lower().replace(" ", "-"), kind, None, None


def time_ms(calls, *, iters, rounds=7):
    """name -> per-call ms of each fn(*args) in `calls` (name -> (fn, args)), or an error string
    for one that fails on this chip. Each is called once first (compile). Then, in each of
    `rounds` rounds, every fn in turn runs `iters` calls dispatched back to back and waited for
    once (an accelerator's figure is its own work, not the host's wait after each call); a fn's
    figure is its median round. Taking turns within each round keeps drift (clocks, heat) out of
    the comparison: timed one after another, two identical kernels measured 0.31 and 0.40 ms on an
    H100 (2026-11-27). Inputs are arguments, not closures, so jit never bakes them in as constants."""
    times = {}
    for name, (fn, args) in calls.items():
        try:
            jax.block_until_ready(fn(*args))
            times[name] = []
        except Exception as e:  # noqa: BLE001 - a benchmark row, not control flow
            times[name] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:80]}"
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            if isinstance(times[name], list):
                start = time.perf_counter()
                jax.block_until_ready([fn(*args) for _ in range(iters)])
                times[name].append((time.perf_counter() - start) / iters)
    return {n: t if isinstance(t, str) else float(np.median(t)) * 1e3 for n, t in times.items()}


def busy_ms(platform, calls, times):
    """name -> ms a call keeps the GPU busy (None off a GPU and for kernels that failed): the
    kernels' own time. A call's wall time (`time_ms`) also holds the host's dispatch of every
    launch, which bound our paged kernel's calls at 30% GPU busy on an H200 (2026-11-28)."""
    if platform != "gpu":
        return dict.fromkeys(times)
    return {name: None if isinstance(ms, str) else gpu_busy_ms(calls[name][0], *calls[name][1])
            for name, ms in times.items()}


# ---------------------------------------------------------------- prefill (flash attention)

def prefill_impls(platform, sm_scale):
    """name -> (prepare, run): prepare(q, k, v) makes the kernel's inputs once (layouts, K/V
    repeated for kernels without GQA), run(*inputs) is timed. q [B, T, H, D], k/v [B, T, KVH, D]."""
    same = lambda q, k, v: (q, k, v)  # noqa: E731
    repeated = lambda q, k, v: (q, repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2]))  # noqa: E731
    impls = {"xla reference": (same, jax.jit(functools.partial(causal_attention, sm_scale=sm_scale)))}
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import attention, attention_mgpu
        from pallas_kernels.flash_attention import gpu
        half = lambda q, k, v: tuple(x.astype(jnp.float16) for x in (q, k, v))  # noqa: E731
        impls["ours (Mosaic GPU)"] = (same, functools.partial(gpu.flash_attention, sm_scale=sm_scale))
        # In attention_mgpu's dtype (it takes float16 only): the like-for-like row against it.
        impls["ours (f16)"] = (half, functools.partial(gpu.flash_attention, sm_scale=sm_scale))
        # Beside the default, the structure before two consumer warpgroups: one warpgroup on 64 q
        # rows (P in registers now, as in the default); with kv blocks of 64, 2 CTAs share an SM.
        # And two warpgroups each at its own pace, not taking turns on the tensor cores; and
        # without the third warpgroup that issues the copies (warpgroup 0 does); and each step's
        # P @ V waiting for the next K tile, as attention_mgpu's does.
        for label, blocks in (("1 warpgroup", dict(block_q=64)),
                              ("1 warpgroup, block_kv 64", dict(block_q=64, block_kv=64)),
                              ("no pingpong", dict(pingpong=False)),
                              ("no producer", dict(producer=False)),
                              ("early K wait", dict(early_k_wait=True))):
            impls[f"ours, {label}"] = (same, functools.partial(gpu.flash_attention, sm_scale=sm_scale, **blocks))
        impls["jax mha (Triton)"] = (repeated, lambda q, k, v: attention.mha(
            q, k, v, None, sm_scale=sm_scale, causal=True))
        # Its own benchmark's choice (attention_mgpu.main): 64 q rows a warpgroup, the largest kv
        # block that fits in SMEM (256 does not at head_dim 128). Until 2026-11-28 this row ran with
        # 128 rows a warpgroup, which made it look 2.7x slower than ours at 4k.
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2,
                                             causal=True)
        impls["jax attention_mgpu (f16)"] = (half, jax.jit(functools.partial(attention_mgpu.attention,
                                                                             config=config)))
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu import flash_attention
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as splash, splash_attention_mask as splash_mask)
        from pallas_kernels.flash_attention import tpu
        impls["ours (Mosaic TPU)"] = (same, functools.partial(tpu.flash_attention, sm_scale=sm_scale))

        def heads_first(q, k, v):  # JAX's TPU kernels: [B, H, T, D], K/V repeated to H heads
            return tuple(x.transpose(0, 2, 1, 3) for x in repeated(q, k, v))

        impls["jax flash_attention"] = (heads_first, functools.partial(
            flash_attention.flash_attention, causal=True, sm_scale=sm_scale))

        def splash_run(q, k, v):  # [B, H, T, D]; splash does not scale
            h, t = q.shape[1], q.shape[2]
            kernel = splash.make_splash_mha_single_device(
                splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t))] * h))
            return jax.vmap(kernel)(q * sm_scale, k, v)

        impls["jax splash_attention"] = (heads_first, jax.jit(splash_run))
    return impls


def repeat_kv(x, num_heads):
    return jnp.repeat(x, num_heads // x.shape[2], axis=2)


def bench_prefill(platform, seq_lens, heads, dtype, iters, peak_tflops):
    num_heads, num_kv_heads, head_dim = heads
    impls = prefill_impls(platform, head_dim ** -0.5)
    rows = []
    for t in seq_lens:
        kq, kk, kv = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(kq, (1, t, num_heads, head_dim), dtype)
        k = jax.random.normal(kk, (1, t, num_kv_heads, head_dim), dtype)
        v = jax.random.normal(kv, (1, t, num_kv_heads, head_dim), dtype)
        flops = 4 * num_heads * head_dim * t * (t + 1) / 2  # QK^T and PV over the causal half
        calls = {name: (run, prepare(q, k, v)) for name, (prepare, run) in impls.items()}
        times = time_ms(calls, iters=iters)
        errs, busy = errors_vs_reference(calls, times), busy_ms(platform, calls, times)
        rows += [perf_row(name, f"T={t}", ms, busy[name], flops=flops, peak_tflops=peak_tflops, err=errs[name])
                 for name, ms in times.items()]
    return rows


def errors_vs_reference(calls, times):
    """name -> our kernel's max abs error against the xla reference ("" for the other rows and
    for kernels that failed): a fast row must also be a right one."""
    expected, errs = None, {}
    for name, ms in times.items():
        errs[name] = ""
        if name.startswith("ours") and not isinstance(ms, str):
            if expected is None:
                ref_run, ref_args = calls["xla reference"]
                expected = ref_run(*ref_args).astype(jnp.float32)
            run, args = calls[name]
            errs[name] = f"{float(jnp.abs(run(*args).astype(jnp.float32) - expected).max()):.1e}"
    return errs


# ---------------------------------------------------------------- decode / mixed (paged)

def paged_case(q_lens, ctx_lens, page_size, heads, dtype, seed=0):
    """A ragged batch with each sequence's pages scattered through the pool."""
    num_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(seed)
    pages_per_seq = max(math.ceil(c / page_size) for c in ctx_lens)
    pages_per_seq = 1 << (pages_per_seq - 1).bit_length()  # JAX's GPU kernel splits it in 2^k
    num_pages = len(ctx_lens) * pages_per_seq
    table = rng.permutation(num_pages).reshape(len(ctx_lens), pages_per_seq).astype(np.int32)
    kk, kv, kq = jax.random.split(jax.random.key(seed), 3)
    shape = (num_pages, num_kv_heads, page_size, head_dim)  # the engine's KV layout
    return dict(
        q=jax.random.normal(kq, (sum(q_lens), num_heads, head_dim), dtype),
        k_pages=jax.random.normal(kk, shape, dtype), v_pages=jax.random.normal(kv, shape, dtype),
        page_table=jnp.asarray(table), seq_lens=jnp.asarray(ctx_lens, jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        max_q=max(q_lens), sm_scale=head_dim ** -0.5)


def paged_impls(platform, case, decode_only, lane=False):
    """name -> (run, inputs), inputs in the kernel's own layout, made once. lane (a GPU): our
    paged kernel under its Lane lowering too (wgmma.compiler_params)."""
    a = tuple(case[n] for n in ("q", "k_pages", "v_pages", "page_table", "seq_lens", "query_start_loc"))
    kw = dict(max_q=case["max_q"], sm_scale=case["sm_scale"])
    impls = {"xla reference": (functools.partial(ragged_paged_attention_xla, **kw), a)}
    if platform in ("gpu", "tpu"):
        from pallas_kernels.paged_attention import gpu, tpu
        name, module = {"gpu": ("ours (Mosaic GPU)", gpu), "tpu": ("ours (Mosaic TPU)", tpu)}[platform]
        impls[name] = (functools.partial(module.ragged_paged_attention, **kw), a)
        if platform == "gpu" and lane:
            impls["ours, Lane lowering"] = (functools.partial(gpu.ragged_paged_attention, lowering="lane", **kw), a)
        if platform == "gpu" and decode_only:   # what splitting the KV gains (where the default splits:
            # few programs), and whether tiles of 128 keys (half the per-tile work, one program per SM) beat 64
            _, num_kv_heads, page_size, _ = case["k_pages"].shape
            seqs, table_width = case["page_table"].shape
            if gpu.pick_kv_splits(num_kv_heads * seqs, table_width * page_size // max(64, page_size)) > 1:
                impls["ours, no KV split"] = (functools.partial(gpu.ragged_paged_attention, kv_splits=1, **kw), a)
            impls["ours, kv_block 128"] = (functools.partial(gpu.ragged_paged_attention, kv_block=128, **kw), a)
    q, k_pages, v_pages, table, lens, qsl = a
    scaled_q = q * case["sm_scale"]  # JAX's paged kernels do not scale
    heads_major = lambda x: x.transpose(1, 0, 2, 3)  # noqa: E731  [KVH, N, page_size, D]
    if platform == "gpu" and decode_only:
        from jax.experimental.pallas.ops.gpu import paged_attention
        splits = min(16, table.shape[1])
        impls["jax paged_attention (Triton)"] = (functools.partial(
            paged_attention.paged_attention, k_splits=splits,
            pages_per_compute_block=min(8, table.shape[1] // splits)),
            (scaled_q, heads_major(k_pages), heads_major(v_pages), table, lens))
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu import paged_attention, ragged_paged_attention
        n, kvh, ps, d = k_pages.shape
        kv = jnp.stack([k_pages, v_pages], axis=2).transpose(0, 3, 1, 2, 4).reshape(  # [N, ps, (KVH, K|V), D]
            n, ps, 2 * kvh, d)
        impls["jax ragged_paged_attention"] = (functools.partial(
            ragged_paged_attention.ragged_paged_attention, sm_scale=case["sm_scale"]),
            (q, kv, lens, table, qsl, jnp.array([len(lens)], jnp.int32)))
        if decode_only:
            impls["jax paged_attention"] = (functools.partial(
                paged_attention.paged_attention, pages_per_compute_block=min(8, table.shape[1])),
                (scaled_q, heads_major(k_pages), heads_major(v_pages), lens, table))
    return impls


def bench_paged(platform, batches, heads, dtype, iters, peaks, profile=False, lane=False):
    """batches: (label, q_lens, ctx_lens, page_size). Reports GB/s of the K/V the batch must read
    (plus q and out) and TFLOP/s of the visible scores; our kernels' max error vs XLA. `profile`
    (a GPU): also prints the kernels of one of our calls and the share of it the GPU was busy."""
    num_heads, num_kv_heads, head_dim = heads
    itemsize = jnp.dtype(dtype).itemsize
    peak_tflops, peak_gbs = peaks
    rows = []
    for label, q_lens, ctx_lens, page_size in batches:
        case = paged_case(q_lens, ctx_lens, page_size, heads, dtype)
        moved = (2 * sum(ctx_lens) * num_kv_heads + 2 * sum(q_lens) * num_heads) * head_dim * itemsize
        visible = sum(ql * c - ql * (ql - 1) / 2 for ql, c in zip(q_lens, ctx_lens))
        impls = paged_impls(platform, case, decode_only=max(q_lens) == 1, lane=lane)
        times = time_ms(impls, iters=iters)
        errs, busy = errors_vs_reference(impls, times), busy_ms(platform, impls, times)
        for name, ms in times.items():
            if profile and platform == "gpu" and name.startswith(("ours (", "jax paged")) and not isinstance(ms, str):
                run, inputs = impls[name]
                profile_gpu(f"{name}, {label}", run, *inputs)
            rows.append(perf_row(name, label, ms, busy[name], bytes_=moved, flops=4 * num_heads * head_dim * visible,
                                 peak_gbs=peak_gbs, peak_tflops=peak_tflops, err=errs[name]))
    return rows


def bench_write_kv(platform, tokens, pool_pages, page_size, heads, dtype, iters, peak_gbs):
    """The scatter of T new K/V rows into a donated pool (in place, as in the engine)."""
    _, num_kv_heads, head_dim = heads
    write = jax.jit(lambda pools, k, v, slots: LayerKV.write(pools, k, v, slots)[0], donate_argnums=0)
    rows = []
    for t in tokens:
        shape = (pool_pages, num_kv_heads, page_size, head_dim)
        pools = [LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))]
        k = v = jnp.ones((t, num_kv_heads, head_dim), dtype)
        slots = jnp.asarray(np.random.default_rng(t).permutation(pool_pages * page_size)[:t], jnp.int32)

        def step():
            pools[:] = [write(pools[0], k, v, slots)]
            return pools

        calls = {"write": (step, ())}
        times = time_ms(calls, iters=iters)
        new_kv = 2 * t * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize  # read once, written once
        rows.append(perf_row("write_kv (XLA scatter)", f"T={t}", times["write"],
                             busy_ms(platform, calls, times)["write"], bytes_=2 * new_kv,
                             peak_gbs=peak_gbs))
    return rows


# ---------------------------------------------------------------- report

def perf_row(name, shape, ms, busy=None, *, flops=None, bytes_=None, peak_tflops=None, peak_gbs=None, err=""):
    """A table row; its rates from `busy` (ms the GPU was busy a call) where measured, else `ms`."""
    def rate(amount, scale, peak):
        if amount is None or isinstance(ms, str):
            return "", ""
        value = amount / ((busy or ms) * 1e-3) / scale
        return f"{value:.3g}", (f"{100 * value / peak:.0f}%" if peak else "n/a")

    tflops, tflops_pct = rate(flops, 1e12, peak_tflops)
    gbs, gbs_pct = rate(bytes_, 1e9, peak_gbs)
    ms = ms if isinstance(ms, str) else f"{ms:.3f}"
    return [name, shape, ms, "" if busy is None else f"{busy:.3f}", tflops, tflops_pct, gbs, gbs_pct, err]


def table(title, rows):
    head = ["kernel", "shape", "ms a call", "GPU ms", "TFLOP/s", "% peak", "GB/s", "% peak", "max err vs xla"]
    return "\n".join([f"### {title}", "", *markdown_table(head, rows)]) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    parser.add_argument("--out", default=RESULTS_DIR)
    parser.add_argument("--sections", default="prefill,decode,mixed,kv_write", help="which tables, in order")
    parser.add_argument("--profile", action="store_true", help="a GPU: print the kernels of our decode and mixed calls")
    parser.add_argument("--lane", action="store_true", help="a GPU: also our paged kernel under its Lane lowering")
    args = parser.parse_args()

    platform = jax.default_backend()
    slug, kind, peak_tflops, peak_gbs = device_info()
    accel = platform in ("gpu", "tpu")
    dtype = jnp.bfloat16 if accel else jnp.float32
    heads = (32, 8, 128)  # Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128
    if args.quick:
        heads, iters = (8, 2, 64), 3
        seq_lens, tokens = [128, 256], [64]
        decode = [(b, c, ps) for b in (4,) for c in (64, 256) for ps in (16, 32)]
        mixed = [("2 x 32-token chunks + 6 decodes", [32, 32] + [1] * 6, [64] * 8, 16)]
    else:
        iters = 20
        seq_lens, tokens = [1024, 4096, 8192], [64, 512, 4096]
        decode = [(64, 2048, 16), (64, 2048, 32)] + [(b, 4096, 16) for b in (8, 128)]
        mixed = [("4 x 512-token chunks + 60 decodes, ctx 2048", [512] * 4 + [1] * 60, [2048] * 64, 16)]
    decode = [(f"B={b} ctx={c} page={ps}", [1] * b, [c] * b, ps) for b, c, ps in decode]

    sections = {   # each table printed as soon as it is measured: a run cut short keeps them in its log
        "prefill": ("Prefill: causal flash attention, batch 1",
                    lambda: bench_prefill(platform, seq_lens, heads, dtype, iters, peak_tflops)),
        "decode": ("Decode: ragged paged attention, 1 token per sequence",
                   lambda: bench_paged(platform, decode, heads, dtype, iters, (peak_tflops, peak_gbs), args.profile,
                                       args.lane)),
        "mixed": ("Mixed: prefill chunks + decodes in one ragged batch",
                  lambda: bench_paged(platform, mixed, heads, dtype, iters, (peak_tflops, peak_gbs), args.profile,
                                      args.lane)),
        "kv_write": ("KV write: scatter of new K/V into the page pool (bytes: read + write)",
                     lambda: bench_write_kv(platform, tokens, 4096 if args.quick else 65536, 16, heads, dtype, iters,
                                            peak_gbs)),
    }
    peak = (f"{peak_tflops} TFLOP/s bf16, {peak_gbs} GB/s HBM (datasheet)" if peak_tflops
            else "no datasheet peak for this device")
    report = [
        f"# Attention kernels on {kind}", "",
        f"jax {jax.__version__}, {datetime.date.today()}, dtype {jnp.dtype(dtype).name}, "
        f"heads (q, kv, dim) = {heads}, {'--quick' if args.quick else 'full'} run. Peak: {peak}.",
        f"Per call: median of 7 rounds of {iters} calls dispatched back to back, after compile; in each "
        "round the kernels of a shape take turns. GPU ms (on a GPU): the time the GPU was busy a call, the "
        "union of its kernels in a profiler trace of 5 calls, without the host's dispatch; the rates "
        "use it where measured.",
        "" if accel else "CPU: XLA reference only (the Pallas kernels need a GPU or TPU).", "",
    ]
    for title, measure in (sections[name] for name in args.sections.split(",")):
        report.append(table(title, measure()))
        print(report[-1], flush=True)
    text = "\n".join(report)
    path = os.path.join(args.out, f"kernels_{slug}{'_quick' if args.quick else ''}.md")
    write_keeping_notes(path, text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
