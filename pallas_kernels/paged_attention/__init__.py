"""Ragged paged attention for serving: a flat batch of new tokens (prefill chunks and decodes
mixed) attending through a page table to the paged KV cache.

  reference.py  jnp reference (the engine's XLA path on CPU)
  tpu.py        Pallas / Mosaic TPU kernel: page DMAs double-buffered by hand
  gpu.py        Pallas / Mosaic GPU kernel (Hopper+)

One call shape (kernel modules are imported on demand by jaxserve.attention.paged_attention):

  out = tpu.ragged_paged_attention(q, k_pages, v_pages, page_table, seq_lens, query_start_loc,
                                   *, max_q, sm_scale, sliding_window=None, soft_cap=None,
                                   alibi_slopes=None, sinks=None, interpret=False)

q [T, H, D]; k/v pages [num_pages, KVH, page_size, D] (H a multiple of KVH; why heads come
before page slots: the KV layout in jaxserve/kv_cache.py); v_pages None: the values are the keys
(latent attention), each kernel reads them from the K pages it has already read; page_table
int32[S, pages_per_seq]; seq_lens int32[S], the KV length after this step; query_start_loc
int32[S + 1]: sequence s owns tokens [query_start_loc[s], query_start_loc[s + 1]), which sit at
positions seq_lens[s] - q_len .. seq_lens[s] - 1 and whose K/V are already in the pages. max_q:
static bound on any q_len. Token at position p sees KV positions (p - sliding_window, p].
out [T, H, D]; tokens outside [query_start_loc[0], query_start_loc[-1]) get 0. soft_cap (Gemma 2)
and alibi_slopes (f32[H], BLOOM / MPT) change the scores, sinks (f32[H], gpt-oss) the softmax, as
pallas_kernels/scores.py says.
"""
