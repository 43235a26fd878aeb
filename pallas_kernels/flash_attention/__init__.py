"""Block-sparse flash attention for prefill.

  masks.py      the one mask description (causal, sliding window, segment ids) and the per-q-block
                list of kv blocks to visit, shared by both kernels
  tpu.py        Pallas / Mosaic TPU kernel
  gpu.py        Pallas / Mosaic GPU kernel (Hopper+)
  reference.py  dense jnp reference (also the XLA path on CPU)

Both kernels have one call shape (kernel modules are imported on demand: importing Mosaic GPU
costs about a second, and the reference is imported by every model):

  from pallas_kernels.flash_attention import tpu   # or gpu
  out = tpu.flash_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None,
                            soft_cap=None, sm_scale=None, block_q=..., block_kv=...,
                            interpret=False)

q [B, T, H, D]; k, v [B, T, KVH, D] with H a multiple of KVH (GQA); segment_ids int [B, T]
(prompts packed into one row); sm_scale defaults to D ** -0.5; out is [B, T, H, D] like q.
"""
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np


def bench_flash(backend, *, batch=1, seq_len=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                dtype=jnp.bfloat16, causal=True, sliding_window=None, iters=20, **kernel_kwargs):
    """Time one attention call on this machine's default device, on random inputs.

    backend: "tpu" or "gpu" (the Pallas kernels) or "xla" (the jnp reference, for a ratio
    measured side by side); kernel_kwargs go to the kernel (block_q, block_kv, interpret, ...).
    Returns {"ms": median milliseconds per call, "tflops": 4 * B * H * T^2 * D FLOPs, halved when
    causal (whatever the window), per second}."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (batch, seq_len, num_heads, head_dim), dtype)
    k = jax.random.normal(kk, (batch, seq_len, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(kv, (batch, seq_len, num_kv_heads, head_dim), dtype)
    if backend == "xla":
        from pallas_kernels.flash_attention.reference import causal_attention
        fn = jax.jit(lambda q, k, v: causal_attention(
            q, k, v, causal=causal, sliding_window=sliding_window, sm_scale=head_dim ** -0.5))
    else:
        kernel = importlib.import_module(f"pallas_kernels.flash_attention.{backend}").flash_attention
        fn = lambda q, k, v: kernel(  # noqa: E731
            q, k, v, causal=causal, sliding_window=sliding_window, **kernel_kwargs)
    fn(q, k, v).block_until_ready()  # compile
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn(q, k, v).block_until_ready()
        times.append(time.perf_counter() - start)
    ms = float(np.median(times)) * 1e3
    flops = 4 * batch * num_heads * seq_len * seq_len * head_dim * (0.5 if causal else 1.0)
    return {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
