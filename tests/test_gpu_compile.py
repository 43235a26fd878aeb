"""The GPU kernels through the real CUDA compilers, with no GPU attached.

jax's compile-only CUDA devices (an H100 SXM target description, jaxserve/assets/targets) take
each kernel as `jax.jit` would on an H100: Mosaic GPU to PTX, and ptxas to sm_90a machine code
inside the executable. What they refuse, an H100 would refuse.
Needs the jax-cuda12-plugin and nvidia-cuda-nvcc-cu12 (ptxas) wheels, no CUDA driver; JAX must
run on CPU (tests/conftest.py), or the plugin would look for a GPU."""
import functools
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.serialize_executable import serialize

from benchmarks import kernel_sass
from jaxserve import check, cli
from jaxserve.buckets import Buckets
from jaxserve.config import EngineConfig, ModelConfig
from pallas_kernels.flash_attention import gpu as flash_gpu
from pallas_kernels.paged_attention import gpu as paged_gpu
from tests.test_tpu_compile import CI_LAYERS, LLAMA3_8B, ROOT, assert_serves, with_ci_layers

ELF_MAGIC = b"\x7fELF"


@pytest.fixture(scope="module")
def h100():
    device = check.gpu_slice("h100").devices[0]
    # An engine test may have switched on the persistent cache: a hit would skip ptxas.
    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield jax.sharding.SingleDeviceSharding(device)
    jax.config.update("jax_enable_compilation_cache", cache)


def spec(sharding, shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def ptxas_report(text):
    """(registers, spill store bytes) from ptxas' verbose output for the one kernel compiled."""
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"bytes stack frame, (\d+) bytes spill stores", text)
    assert len(regs) == 1 and len(spills) == 1, text
    return int(regs[0]), int(spills[0])


def compile_for_h100(fn, args, monkeypatch, capfd):
    """Compiles fn(*args); returns ptxas' (registers, spill store bytes) for its one kernel."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")  # ptxas -v, printed to stdout by the plugin
    capfd.readouterr()
    compiled = fn.trace(*args).lower().compile()
    assert ELF_MAGIC in serialize(compiled)[0]  # sm_90a machine code inside the executable
    return ptxas_report(capfd.readouterr().out)


FLASH = {  # name: (head_dim, segment ids, flash_attention options; alibi=True, sinks=True: those passed)
    "causal-d64": (64, False, dict(causal=True)),
    "all-features-d64": (64, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True, sinks=True)),
    "all-features-d128": (128, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True)),
    "all-but-alibi-d128": (128, True, dict(causal=True, sliding_window=300, soft_cap=30.0)),
    "causal-d256": (256, False, dict(causal=True)),  # block_kv 64: the largest that fits
    "all-features-d256": (256, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True)),
    "bidirectional-d64": (64, False, dict(causal=False)),
    # One consumer warpgroup, and two at their own pace: knobs kept for side-by-side timing.
    "causal-d128-1wg": (128, False, dict(causal=True, block_q=64)),
    "all-features-d128-no-pingpong": (128, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True,
                                                      pingpong=False)),
    "all-features-d128-1wg-kv64": (128, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True,
                                                   block_q=64, block_kv=64)),
    # Warpgroup 0 issuing the copies, no producer warpgroup.
    "causal-d128-no-producer": (128, False, dict(causal=True, producer=False)),
    "all-features-d128-no-producer": (128, True, dict(causal=True, sliding_window=300, soft_cap=30.0, alibi=True,
                                                      producer=False)),
    "causal-d128-early-k-wait": (128, False, dict(causal=True, early_k_wait=True)),
    "gpt-oss-d64": (64, True, dict(causal=True, sliding_window=128, sinks=True)),   # attention sinks
}


def flash_register_limit(head_dim, opts):
    """255 a thread at most, and a CTA's warpgroups (128 threads each) share an SM's 65,536: at
    launch; the producer's split (setmaxnreg) then moves registers to the consumers."""
    consumers = opts.get("block_q", 128) // 64
    producer = consumers == 2 and opts.get("producer", head_dim <= 128)
    return min(255, 65536 // (128 * (consumers + producer)))


# causal-d128, the default kernel at Llama's head_dim: test_flash_full_tile_loop_is_as_lean_as_attention_mgpu.
@pytest.mark.parametrize("name", FLASH)
def test_flash_kernel_compiles_for_h100(h100, name, monkeypatch, capfd):
    head_dim, segments, opts = FLASH[name]
    opts = dict(opts)
    alibi, sinks = opts.pop("alibi", False), opts.pop("sinks", False)
    b, t, h, kvh = 1, 512, 8, 2
    args = [spec(h100, (b, t, h, head_dim)), spec(h100, (b, t, kvh, head_dim)),
            spec(h100, (b, t, kvh, head_dim)), spec(h100, (b, t), jnp.int32) if segments else None,
            spec(h100, (h,), jnp.float32) if alibi else None, spec(h100, (h,), jnp.float32) if sinks else None]
    fn = jax.jit(lambda q, k, v, seg, slopes, sinks: flash_gpu.flash_attention(
        q, k, v, segment_ids=seg, alibi_slopes=slopes, sinks=sinks, **opts))
    regs, spills = compile_for_h100(fn, args, monkeypatch, capfd)
    print(f"flash {name}: {regs} registers, {spills} bytes spilled")
    assert regs <= flash_register_limit(head_dim, opts) and spills == 0, (regs, spills)


def test_flash_full_tile_loop_is_as_lean_as_attention_mgpu(monkeypatch):
    """The causal 4k kernel's machine code (benchmarks/kernel_sass.py; head_dim 128, the default
    options): within the register limit, no spills (ptxas' report, as in the test above); the FULL
    tiles' kv loop holds no mask code, and as many instructions as JAX's attention_mgpu's unmasked
    loop, within 5% (478 against 469 when written): a step's work on most tiles, held to the
    shipped kernel's."""
    monkeypatch.setenv("MOSAIC_GPU_DUMP_PTXAS", "1")   # ptxas -v, printed beside the SASS
    ours = kernel_sass.sass(kernel_sass.CASES["ours"])
    regs, spills = ptxas_report("\n".join(ours))
    assert regs <= flash_register_limit(128, {}) and spills == 0, (regs, spills)
    ours, theirs = kernel_sass.kv_loops(ours), kernel_sass.kv_loops(kernel_sass.sass(kernel_sass.CASES[
        "jax attention_mgpu (f16)"]))
    assert len(ours) == 2 and len(theirs) == 2, (ours, theirs)   # FULL tiles' loop, then PARTIAL tiles'
    full, partial = ours
    assert full["HGMMA.64x128x16.F32.BF16"] == partial["HGMMA.64x128x16.F32.BF16"] == 16
    assert not any(op.startswith(("ISETP", "FSEL")) for op in full), full
    assert sum(full.values()) <= 1.05 * sum(theirs[0].values()), (sum(full.values()), sum(theirs[0].values()))


# Every pair of values of any two columns (and of row bytes: the swizzle width) is in some row; rows
# whose every pair is in others are left out (mixed-d128, mixed-d64-window, decode-d128-int8; d128
# bf16 pages also compile in the Llama-3-8B steps below).
PAGED = {  # name: (head_dim, sliding_window, max_q, page_size, kv_block, mods, pool dtype[, kv_splits])
    "decode-d32": (32, None, 1, 16, 64, "", "bfloat16"),  # 64-byte swizzle
    "decode-d64": (64, None, 1, 16, 64, "", "bfloat16"),
    "mixed-d96": (96, None, 64, 16, 64, "", "bfloat16"),  # 64-byte swizzle, 3 spans a row
    "decode-d128-window": (128, 1024, 1, 16, 64, "", "bfloat16"),
    "mixed-d128-page128": (128, None, 64, 128, 128, "", "bfloat16"),
    "decode-d128-softcap-alibi": (128, None, 1, 16, 64, "softcap-alibi", "bfloat16"),
    "mixed-d64-window-softcap-alibi": (64, 1024, 64, 16, 64, "softcap-alibi", "bfloat16"),
    # Quantized pools (int8, fp8 e4m3) with their f32 scales: each tile dequantized in SMEM.
    "mixed-d64-window-int8": (64, 1024, 64, 16, 64, "", "int8"),  # 64-byte swizzle for int8 rows
    "mixed-d128-page128-int8": (128, None, 64, 128, 128, "", "int8"),  # 2 blocks of 64 rows a tile
    "decode-d32-fp8-softcap-alibi": (32, None, 1, 16, 64, "softcap-alibi", "float8_e4m3fn"),  # 32-byte swizzle
    "mixed-d128-fp8": (128, None, 64, 16, 64, "", "float8_e4m3fn"),
    # Split KV (each split's output and log-sum-exp written, then merged by XLA).
    "decode-d128-split4": (128, None, 1, 16, 64, "", "bfloat16", 4),
    "decode-d128-kv128": (128, None, 1, 16, 128, "", "bfloat16"),  # 8 page copies a tile
    "decode-d64-window-softcap-alibi-int8-split3": (64, 1024, 1, 16, 64, "softcap-alibi", "int8", 3),
    # Attention sinks (gpt-oss): each row's log-sum-exp written unsplit too, the sink added by XLA.
    "mixed-d64-window-sinks": (64, 128, 64, 16, 64, "sinks", "bfloat16"),
    # No V pool (latent attention): the K tile serves as V, one copy a page.
    "mixed-d128-values_are_keys": (128, None, 64, 16, 64, "values_are_keys", "bfloat16"),
    "decode-d128-int8-values_are_keys": (128, None, 1, 16, 64, "values_are_keys", "int8"),
}


@pytest.mark.parametrize("name", PAGED)
def test_paged_kernel_compiles_for_h100(h100, name, monkeypatch, capfd):
    head_dim, window, max_q, page_size, kv_block, mods, pool_dtype, *kv_splits = PAGED[name]
    tokens, num_heads, num_kv_heads, num_pages, seqs, pages_per_seq = 125, 32, 8, 512, 64, 64
    pages = spec(h100, (num_pages, num_kv_heads, page_size, head_dim), jnp.dtype(pool_dtype))
    scales = spec(h100, (num_pages, num_kv_heads, 1, page_size), jnp.float32) if pool_dtype != "bfloat16" else None
    v_pages, v_scales = (None, None) if "values_are_keys" in mods else (pages, scales)
    args = [spec(h100, (tokens, num_heads, head_dim)), pages, v_pages,
            spec(h100, (seqs, pages_per_seq), jnp.int32), spec(h100, (seqs,), jnp.int32),
            spec(h100, (seqs + 1,), jnp.int32), *(spec(h100, (num_heads,), jnp.float32) if mod in mods else None
                                                  for mod in ("alibi", "sinks")), scales, v_scales]
    kernel = functools.partial(paged_gpu.ragged_paged_attention, max_q=max_q, sm_scale=head_dim ** -0.5,
                               sliding_window=window, soft_cap=30.0 if "softcap" in mods else None,
                               kv_block=kv_block, kv_splits=kv_splits[0] if kv_splits else None)
    fn = jax.jit(lambda *a: kernel(*a[:-4], alibi_slopes=a[-4], sinks=a[-3], k_scale=a[-2], v_scale=a[-1]))
    regs, spills = compile_for_h100(fn, args, monkeypatch, capfd)
    print(f"paged {name}: {regs} registers, {spills} bytes spilled")
    assert regs <= 255 and spills == 0, (regs, spills)


def test_llama3_8b_steps_compile_for_one_h100(monkeypatch):
    """`jaxserve check` on one H100: configs/llama3-8b-h100.yaml with decode_steps 8 (CI_LAYERS of
    the 32 layers, the pool sized for all 32) through XLA:GPU, Mosaic GPU and ptxas: its largest
    prefill step (the flash kernel beside the paged one, whose many programs need no KV split),
    its smallest decode step (few programs: its paged kernel splits the KV) and that step's
    multi-step decodes, without and with top-k/top-p (sampling.sample's `filters`) and with
    penalties and a bias (and the filters). They fit, pass no kernel a slice at an offset (Mosaic
    GPU refuses operands not 256-byte aligned) and hold no conditional: XLA:GPU reads each one's
    predicate on the host, which would hold the launching host in the loop until the GPU got
    there (the sampler's other path has 3). Not here (suite time): the largest decode step,
    decode-128, and its loops: decode-8's programs over more rows, its kernel unsplit as the
    prefill step's."""
    splits = []   # each paged kernel call's KV splits, as traced
    pick = paged_gpu.pick_kv_splits
    monkeypatch.setattr(paged_gpu, "pick_kv_splits", lambda *a: splits.append(pick(*a)) or splits[-1])
    ecfg = EngineConfig.from_yaml(os.path.join(ROOT, "configs", "llama3-8b-h100.yaml"), decode_steps=8)
    h100 = check.gpu_slice("h100")
    cfg = with_ci_layers(ModelConfig.from_pretrained(LLAMA3_8B), ecfg, h100, 1, "llama3-8b")
    shapes = check.quick_shapes(Buckets(ecfg, platform="gpu").warmup_shapes(False))
    assert [s.name for s in shapes] == ["decode-128", "decode-8", "prefill-1024x4q512"]
    report = check.check(ecfg, cfg, h100, model_name="llama3-8b", dtype=jnp.bfloat16, shapes=shapes[1:],
                         samplers=False)
    assert_serves(report, f"llama3-8b ({CI_LAYERS} layers) on h100, decode_steps 8")
    assert [r.name for r in report.results] == ["decode-8", "prefill-1024x4q512"] + [
        f"decode-8-x8{v}" for v in ("", "-filters", "-penalties-bias-filters")] + ["page-copy"]
    assert [(r.conditionals, r.sliced_kernel_operands) for r in report.results] == [(0, 0)] * len(report.results), \
        report.results
    assert 1 in splits and max(splits) > 1, splits   # the prefill step's, decode-8's


def test_llama3_70b_on_one_h100_is_refused(capsys):
    """141 GB of bf16 weights beside the 59 GiB JAX takes of an 80 GB card: refused, with the
    GPU count that fits."""
    code = cli.main(["check", "--config", os.path.join(ROOT, "configs", "llama3-8b-h100.yaml"),
                     "--topology", "h100", "--model", os.path.join(ROOT, "configs", "models", "llama3-70b")])
    out = capsys.readouterr().out
    assert code == 1
    assert "DOES NOT FIT: llama3-70b bfloat16 needs at least 4 h100 chips: set mesh model: 4" in out, out
