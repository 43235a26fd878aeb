"""Block-sparse flash attention: both Pallas kernels in interpret mode on CPU (the GPU kernel
compiled for real on a GPU) against the jnp reference, the block schedule against a dense token
mask, and lowering for the real chips."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as gpu_interpret

from pallas_kernels.flash_attention import gpu, tpu
from pallas_kernels.flash_attention.masks import Mask, block_schedule
from pallas_kernels.flash_attention.reference import causal_attention
from tests.conftest import fake_devices_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_INTERPRET = jax.default_backend() != "gpu"   # on a GPU the GPU kernels run compiled
MAX_ABS_ERR = {"float32": 2e-3, "bfloat16": 2e-2}
SLOW = settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
schedule = jax.jit(block_schedule, static_argnums=(0, 2, 3))  # as inside the kernels' jit


@st.composite
def attention_cases(draw, max_len):
    t = draw(st.integers(1, max_len))
    causal = draw(st.booleans())
    return dict(
        batch=1,  # batch 2 is pinned below: interpret mode pays for every grid step
        seq_len=t,
        group=draw(st.sampled_from([1, 4, 8])),
        head_dim=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        causal=causal,
        sliding_window=draw(st.none() | st.integers(1, t)) if causal else None,
        soft_cap=draw(st.none() | st.floats(2.0, 50.0)),
        alibi=draw(st.booleans()),
        sinks=draw(st.booleans()),
        segments=draw(st.sampled_from([None, "packed", "shuffled"])),
        seed=draw(st.integers(0, 2**16)),
    )


def make_inputs(case):
    b, t, g, d = case["batch"], case["seq_len"], case["group"], case["head_dim"]
    kvh = case.get("kv_heads", 2 if g == 1 else 1)  # few q heads: interpret mode pays for every one
    kq, kk, kv, ks, ka = jax.random.split(jax.random.key(case["seed"]), 5)
    dtype = jnp.dtype(case["dtype"])
    q = jax.random.normal(kq, (b, t, kvh * g, d), dtype)
    k = jax.random.normal(kk, (b, t, kvh, d), dtype)
    v = jax.random.normal(kv, (b, t, kvh, d), dtype)
    seg = None
    if case["segments"] == "packed":  # prompts packed back to back: ids non-decreasing
        seg = jnp.cumsum(jax.random.bernoulli(ks, 0.05, (b, t)), axis=1, dtype=jnp.int32)
    elif case["segments"] == "shuffled":  # any layout must stay correct, even if less sparse
        seg = jax.random.randint(ks, (b, t), 0, 3)
    slopes = jax.random.uniform(ka, (kvh * g,), jnp.float32, 0.01, 0.5) if case["alibi"] else None
    # sink logits about as large as the scores: some rows' weight mostly on the sink, some not
    sinks = jax.random.uniform(jax.random.fold_in(ka, 1), (kvh * g,), jnp.float32, -2.0, 4.0)
    return q, k, v, seg, slopes, sinks if case.get("sinks") else None


def check_against_reference(kernel, case, **blocks):
    q, k, v, seg, slopes, sinks = make_inputs(case)
    opts = dict(causal=case["causal"], sliding_window=case["sliding_window"], soft_cap=case["soft_cap"],
                alibi_slopes=slopes, sinks=sinks)
    gpu_interpret.reset_gpu_interpret_mode_state()  # a failed run (while shrinking) leaves state
    # Waited for before the eager reference: ops queued behind a running interpreted kernel can
    # hang it (jaxserve/attention._waited_for).
    out = jax.block_until_ready(kernel.flash_attention(q, k, v, segment_ids=seg,
                                                       interpret=kernel is tpu or GPU_INTERPRET, **blocks, **opts))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  the reference runs in f32 on the same inputs
    ref = causal_attention(f32(q), f32(k), f32(v), sm_scale=case["head_dim"] ** -0.5,
                           segment_ids=seg, **opts)
    assert out.shape == q.shape and out.dtype == q.dtype
    err = float(jnp.abs(f32(out) - ref).max())
    assert err < MAX_ABS_ERR[case["dtype"]], f"max abs error {err}"


# Groups of 2 q heads on each of 2 KV heads (per-head ALiBi slopes and sinks): q head h must read KV head
# h // group, which cases with one KV head or groups of one cannot tell from another mapping.
ALL_FEATURES = dict(batch=1, seq_len=96, group=2, kv_heads=2, head_dim=128, dtype="bfloat16", causal=True,
                    sliding_window=40, soft_cap=20.0, alibi=True, sinks=True, segments="packed", seed=1)
BIDIRECTIONAL = dict(batch=2, seq_len=50, group=4, head_dim=64, dtype="float32", causal=False,
                     sliding_window=None, soft_cap=None, alibi=True, segments="shuffled", seed=2)
# Without segment ids the GPU kernel reads none, unless a bidirectional mask must hide padding:
# causal and padded (the mask hides it), bidirectional and padded (segments needed), and FULL tiles.
PLAIN_CAUSAL = dict(batch=1, seq_len=100, group=1, head_dim=64, dtype="float32", causal=True,
                    sliding_window=None, soft_cap=None, alibi=False, segments=None, seed=3)
NO_SEGMENTS = [dict(BIDIRECTIONAL, batch=1, seq_len=50, segments=None),    # padded: segments needed
               dict(BIDIRECTIONAL, batch=1, seq_len=128, segments=None)]   # every tile FULL


@pytest.mark.parametrize("alibi", [False, True])
def test_reference_sinks_match_numpy(alibi):
    """The jnp reference's sinks against the softmax-with-sink formula written out per row in
    float64 (gpt-oss as transformers computes it): GQA, a sliding window, packed segments; one
    head's sink far above every score (its rows' output nearly 0), one far below (plain softmax).
    With ALiBi too, as its paper writes it (-slope * distance; no model has both): the reference
    adds slope * packed key index, so the sink must follow the row's index (scores.py)."""
    rng = np.random.default_rng(0)
    t, h, kvh, d, window = 24, 4, 2, 16, 6
    q, k, v = (rng.standard_normal((1, t, n, d)) for n in (h, kvh, kvh))
    seg = np.repeat([0, 1, 2], [9, 10, 5])[None]
    sinks = np.array([0.5, 30.0, -1.0, -30.0])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625]) if alibi else np.zeros(h)
    out = causal_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), sm_scale=d ** -0.5,
                           sliding_window=window, segment_ids=jnp.asarray(seg), sinks=jnp.asarray(sinks, jnp.float32),
                           alibi_slopes=jnp.asarray(slopes, jnp.float32) if alibi else None)
    expected = np.zeros((t, h, d))
    for i in range(t):
        seen = [j for j in range(t) if j <= i and j > i - window and seg[0, j] == seg[0, i]]
        for head in range(h):
            scores = k[0, seen, head // 2] @ q[0, i, head] * d ** -0.5 - slopes[head] * (i - np.array(seen))
            logits = np.append(scores, sinks[head])
            w = np.exp(logits - logits.max())
            expected[i, head] = (w / w.sum())[:-1] @ v[0, seen, head // 2]
    np.testing.assert_allclose(np.asarray(out[0]), expected, atol=1e-5)
    assert np.abs(expected[:, 1]).max() < 1e-6   # head 1's sink took (nearly) all the weight


@SLOW
@example(ALL_FEATURES)
@example(BIDIRECTIONAL)
@example(PLAIN_CAUSAL)
@given(attention_cases(max_len=96))
def test_tpu_kernel_matches_reference(case):
    check_against_reference(tpu, case, block_q=32, block_kv=32)


@SLOW
@example(ALL_FEATURES)
@example(BIDIRECTIONAL)
@example(PLAIN_CAUSAL)
@example(NO_SEGMENTS[0])
@example(NO_SEGMENTS[1])
@given(attention_cases(max_len=128))
def test_gpu_kernel_matches_reference(case):
    check_gpu(case, block_q=64, block_kv=64)  # one warpgroup: interpreted in this process (see below)


def check_gpu(case, **blocks):
    # compiled, wgmma takes 16-bit operands only
    check_against_reference(gpu, case if GPU_INTERPRET else dict(case, dtype="bfloat16"), **blocks)
    # the interpreter runs its race detector (flash_attention/gpu.py), shown to fire on kernels
    # whose warpgroups release a K or V slot before they have read it
    assert not GPU_INTERPRET or not gpu_interpret.get_races().races_found


# 320 tokens, window 150, kv blocks of 64: q blocks of 128 rows visit up to 5 kv blocks (4 with 64
# rows), so each K/V slot is refilled while the other warpgroup may still read it. One head: races
# are within a CTA (ALL_FEATURES checks which KV head each q head reads).
KV_SLOT_REUSE = dict(ALL_FEATURES, seq_len=320, group=1, kv_heads=1, sliding_window=150, segments=None)


def test_gpu_kernel_one_warpgroup_reuses_kv_slots():
    check_gpu(KV_SLOT_REUSE, block_q=64, block_kv=64)
    check_gpu(KV_SLOT_REUSE, block_q=64, block_kv=64, early_k_wait=True)


def check_more_warpgroups():
    # Few heads: interpreted, each head (and batch row) is a CTA of its own (2 s each). 2 q heads
    # on kv head 0 with every score feature, 2 batch rows of one head; larger groups and 2 KV heads
    # run on one warpgroup above.
    for case in (dict(ALL_FEATURES, kv_heads=1), dict(BIDIRECTIONAL, group=1, kv_heads=1), KV_SLOT_REUSE):
        check_gpu(case, block_q=128, block_kv=64)   # taking turns on the tensor cores (pingpong)
    # The variants change how the warpgroups wait for each other, not the arithmetic: each on
    # the case that cycles the K/V slots (5 KV blocks a q block).
    check_gpu(KV_SLOT_REUSE, block_q=128, block_kv=64, pingpong=False)   # each at its own pace
    check_gpu(KV_SLOT_REUSE, block_q=128, block_kv=64, producer=False)   # warpgroup 0 issuing the copies
    check_gpu(KV_SLOT_REUSE, block_q=128, block_kv=64, early_k_wait=True)   # P @ V waiting for the next K tile


def test_gpu_kernel_two_warpgroups():
    """The default: two consumer warpgroups sharing each K/V tile, taking turns, and a producer
    warpgroup issuing the copies; and without the turns, or the producer; and with early K waits."""
    if not GPU_INTERPRET:
        return check_more_warpgroups()
    # Interpreted, each warpgroup is a program of its own and both run at once on XLA:CPU's
    # threads. In a process of one CPU device on 2 cores, one warpgroup's program blocked on a
    # barrier while the other's never started, in about half the runs (jax 0.10.2); with 4 fake
    # devices none hung in 5 runs.
    proc = subprocess.run([sys.executable, "-c", "import tests.test_flash_attention as t; t.check_more_warpgroups()"],
                          cwd=ROOT, env=fake_devices_env(4), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("static", [False, True])  # segment ids traced (jnp), or none (numpy)
@pytest.mark.parametrize("block_q,block_kv", [(128, 128), (64, 128)])  # defaults; a 1-warpgroup GPU block
def test_causal_4k_prompt_visits_about_half_the_kv_blocks(block_q, block_kv, static):
    t = 4096
    nq, nk = t // block_q, t // block_kv
    if static:  # what the kernels compute without segment ids: constants of the compiled call
        sched = block_schedule(Mask(causal=True), np.zeros((1, t), np.int32), block_q, block_kv)
        assert all(isinstance(x, np.ndarray) for x in sched)
    else:
        sched = jax.device_get(schedule(Mask(causal=True), jnp.zeros((1, t), jnp.int32), block_q, block_kv))
    kv_block, full_count, count = sched.kv_block[0], sched.full[0], sched.count[0]

    # Ground truth from the dense token mask: tiles with any / only visible pairs.
    pos = np.arange(t)
    tiles = (pos[None, :] <= pos[:, None]).reshape(nq, block_q, nk, block_kv)
    needed, full = tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))
    visited = np.zeros((nq, nk), bool)
    for i in range(nq):
        blocks = kv_block[i, :count[i]]
        visited[i, blocks] = True
        # The FULL tiles first, then the PARTIAL ones, each group once and in order.
        assert full[i, blocks[:full_count[i]]].all() and not full[i, blocks[full_count[i]:]].any()
        assert (np.diff(blocks[:full_count[i]]) > 0).all() and (np.diff(blocks[full_count[i]:]) > 0).all()
        # The TPU pipeline copies K/V only when the block index changes from one step to the next.
        assert 1 + (np.diff(kv_block[i]) != 0).sum() == count[i]
    np.testing.assert_array_equal(visited, needed)
    fraction = count.sum() / (nq * nk)
    assert 0.45 < fraction < 0.55, fraction


def test_packed_prompts_visit_only_their_own_blocks():
    t, block = 4096, 128  # four 1k-token prompts in one row: blocks of other prompts are skipped
    seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
    count = jax.device_get(schedule(Mask(causal=True), seg, block, block).count[0])
    fraction = count.sum() / (t // block) ** 2
    assert 0.1 < fraction < 0.15, fraction  # ~1/8: each prompt's own causal triangle


LOWERING_CASE = dict(causal=True, sliding_window=300, soft_cap=30.0)


def lower(kernel, platform):
    b, t, h, kvh, d = 1, 512, 8, 2, 128
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)
    fn = jax.jit(lambda q, k, v, s: kernel.flash_attention(q, k, v, segment_ids=s, **LOWERING_CASE))
    return fn.trace(q, kv, kv, seg).lower(lowering_platforms=(platform,)).as_text()


def test_tpu_kernel_lowers_to_mosaic_tpu():
    assert "tpu_custom_call" in lower(tpu, "tpu")  # block shapes and ops pass Pallas' TPU checks


def test_gpu_kernel_lowers_to_mosaic_gpu():
    assert "mosaic_gpu" in lower(gpu, "cuda")  # layouts, wgmma operands and TMA copies check out
