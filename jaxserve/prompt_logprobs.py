"""Prompt logprobs, from the hidden states of the prefill steps themselves (no second pass).

A prefill chunk covering prompt positions [a, b) has, at position p, the hidden state that
predicts prompt token p + 1: it yields the logprobs of prompt tokens a+1 .. min(b, len-1). The
runner packs the step's rows that need them (`pack`) and, only in a step that has such a row,
runs `compute` on the step's hidden states: lm_head, log-softmax in f32, the logprob and rank of
the next prompt token and the top MAX_LOGPROBS, CHUNK_ROWS rows at a time. One compilation per
token bucket, at warm-up.
Results accumulate on the sequence (seq.prompt_logprobs, entry k for prompt token k + 1), so a
chunk recomputed after a preemption adds nothing twice. Cached prefix pages have no hidden
states: a sequence asking prompt logprobs skips the prefix-cache match (its pages are still
cached for others), as vLLM does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve import parallel


def pack(rows, num_tokens: int):
    """rows: (scheduled row, index of its first token in the step) for the step's rows. Returns
    (seqs, counts, (index, targets)) for the rows that need prompt logprobs, or None when none
    does: index [num_tokens] are the hidden rows to score, targets the prompt tokens they predict
    (padding repeats row 0, ignored)."""
    seqs, counts, index, targets = [], [], [], []
    for s, cursor in rows:
        seq = s.seq
        if seq.sampling.prompt_logprobs is None:
            continue
        start = seq.num_computed_tokens
        first = max(start, len(seq.prompt_logprobs))          # positions already scored are skipped
        end = min(start + s.num_query_tokens, seq.num_prompt_tokens - 1)
        if first >= end:
            continue
        positions = np.arange(first, end)
        index += (cursor + positions - start).tolist()
        targets += [seq.prompt_token_ids[p + 1] for p in positions]
        seqs.append(seq)
        counts.append(len(positions))
    if not seqs:
        return None
    pad = num_tokens - len(index)
    arrays = (np.array(index + [0] * pad, np.int32), np.array(targets + [0] * pad, np.int32))
    return seqs, counts, arrays


# Rows scored at once: the [rows, vocab] f32 log-softmax is what bounds the scorer's memory
# (128 MiB at a 128k vocabulary; a whole 8192-token step at once would be 4 GiB).
CHUNK_ROWS = 256


@functools.partial(jax.jit, static_argnames=("model", "num_top", "logits_sharding", "chunk_rows"))
def compute(model, params, hidden, index, targets, *, num_top: int, logits_sharding, chunk_rows: int = CHUNK_ROWS):
    """(logprob of each target [T], its rank (1 = argmax) [T], top ids [T, num_top], top
    logprobs [T, num_top]) for the hidden rows `index`, scored chunk_rows rows at a time."""
    n = index.shape[0]
    rows = min(n, chunk_rows)
    chunks = [jnp.pad(x, (0, -n % rows)).reshape(-1, rows) for x in (index, targets)]

    def score(chunk):
        index, targets = chunk
        logits = model.apply({"params": params}, hidden[index], method=model.logits)
        logits = jax.lax.with_sharding_constraint(logits, logits_sharding)
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(logits_sharding.mesh))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        target = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(logp > target[:, None], axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logp, num_top)
        return target, rank, top_ids, top_logprobs
    return tuple(x.reshape(-1, *x.shape[2:])[:n] for x in jax.lax.map(score, chunks))


def accumulate(seqs, counts: list[int], targets: np.ndarray, result, entry) -> None:
    """Append `compute`'s result rows to each sequence's prompt_logprobs, in `pack`'s order, as
    entry(token, logprob, top [(id, logprob)] of the requested size, rank)."""
    target, rank, top_ids, top_logprobs = result
    row = 0
    for seq, n in zip(seqs, counts):
        k = seq.sampling.prompt_logprobs
        for i in range(row, row + n):
            top = list(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))
            seq.prompt_logprobs.append(entry(int(targets[i]), float(target[i]), top, int(rank[i])))
        row += n
