"""Block-sparse flash attention for prefill. Used by jaxserve.attention (Pallas backends) in
steps with prefill rows, for those without a cached prefix (see `_pallas_rows` there).

  masks.py      the one mask description (causal, sliding window, segment ids) and the per-q-block
                list of kv blocks to visit, shared by both kernels
  tpu.py        Pallas / Mosaic TPU kernel
  gpu.py        Pallas / Mosaic GPU kernel (Hopper+)
  reference.py  dense jnp reference (also the XLA path on CPU)

Both kernels have one call shape (kernel modules are imported on demand: importing Mosaic GPU
costs about a second, and the reference is imported by every model):

  from pallas_kernels.flash_attention import tpu   # or gpu
  out = tpu.flash_attention(q, k, v, *, segment_ids=None, causal=True, sliding_window=None,
                            soft_cap=None, alibi_slopes=None, sinks=None, sm_scale=None,
                            block_q=..., block_kv=..., interpret=False)

q [B, T, H, D]; k, v [B, T, KVH, D] with H a multiple of KVH (GQA); segment_ids int [B, T]
(prompts packed into one row); alibi_slopes f32[H] or None (ALiBi by key index, exact within a
segment: pallas_kernels/scores.py); sinks f32[H] or None (each head's sink logit joins the
softmax: pallas_kernels/scores.py); sm_scale defaults to D ** -0.5; out is [B, T, H, D] like q.
benchmarks/kernels.py times both against the reference and JAX's shipped kernels.
"""
