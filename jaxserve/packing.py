"""Packing: a scheduled ragged batch as one step's bucketed fixed-shape host arrays."""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from jaxserve import pooling, prompt_logprobs
from jaxserve.buckets import Buckets, StepShape, bucket, cover, drop_lone_group
from jaxserve.scheduler import SchedulerOutput
from jaxserve.sequence import PENDING


class Batch(NamedTuple):
    """One batched step's host arrays and what the runner needs to read its results."""
    arrays: tuple
    sampling_seqs: list
    num_prefill_rows: int
    max_q: int
    decode_q: int
    prompt_logprobs: tuple | None   # prompt_logprobs.pack's (seqs, counts, arrays), None: no row asks
    pooling: tuple | None           # pooling.pack's (seqs, arrays), None: no row pools
    pending: list                   # (position in tokens, sequence) of each PENDING input token
    lora_slots: np.ndarray          # each token's LoRA adapter slot (0: none; jaxserve/lora.py)


def pack(out: SchedulerOutput, buckets: Buckets, max_pages_per_seq: int, num_pages: int,
         page_size: int, ready: frozenset[StepShape] | None = None, groups: int = 1) -> Batch:
    """The scheduled rows as the step's fixed-shape host arrays (see the runner's docstring):
    prefill rows first, those without a cached prefix leading (jaxserve/attention.py runs them
    through the flash kernel), then decode rows (one token, or a verify row's 1 + k) longest context
    first, padded to `buckets` (to the smallest `ready` shape that holds them while warm-up
    builds the others: buckets.cover); decode rows are 1 + k wide only in a step with a verify
    row. A row sampling n tokens has its last n positions in logits_index and its sequence n
    times in sampling_seqs. A PENDING input token (a decode row's token sampled by the step
    still running) is left for the device to read (`pending`). groups > 1 (KV groups,
    jaxserve/kv_groups.py): page_table [groups, rows, P] and slot_mapping [groups, T], a row's
    pages of each group (NULL_PAGE where a sliding window released them)."""
    prefill = sorted((s for s in out.scheduled if s.is_prefill_row), key=lambda s: s.seq.num_computed_tokens > 0)
    decode = sorted((s for s in out.scheduled if not s.is_prefill_row),
                    key=lambda s: -s.seq.num_computed_tokens)
    num_tokens = out.num_tokens
    dq = buckets.step_decode_q(any(s.num_query_tokens > 1 for s in decode))
    if prefill:
        if len(prefill) > buckets.prefill_rows[-1]:
            raise ValueError(f"{len(prefill)} prefill rows > max_prefill_seqs")
        sp = bucket(len(prefill), buckets.prefill_rows)
        t = bucket(num_tokens, buckets.tokens)
        sd = buckets.decode[-1]
        max_q = bucket(max(s.num_query_tokens for s in prefill), buckets.max_q_options(t, dq))
    else:
        sp = 0
        sd = bucket(len(decode), buckets.decode)
        t = sd * dq
        max_q = dq
    shape = cover(StepShape(t, sd, sp, max_q, dq), ready)
    t, sd, sp, max_q, dq = shape.tokens, shape.decode_rows, shape.prefill_rows, shape.max_q, shape.decode_q
    rows: list = prefill + [None] * (sp - len(prefill)) + decode + [None] * (sd - len(decode))
    # Each row's figures as Python ints, then every array at once (per-row numpy calls cost
    # more than all the rest of a step's host work).
    real = [(r, s) for r, s in enumerate(rows) if s is not None]
    index = np.array([r for r, _ in real], np.int64)
    starts = np.array([s.seq.num_computed_tokens for _, s in real], np.int64)
    counts = np.array([s.num_query_tokens for _, s in real], np.int64)
    sampled = np.array([s.num_sampled for _, s in real], np.int64)
    queries = [s.query_token_ids for _, s in real]
    qsl = np.zeros(len(rows) + 1, np.int32)
    qsl[index + 1] = counts
    qsl = np.cumsum(qsl, dtype=np.int32)
    cursors = qsl[index]                        # each row's first token in the step
    seq_lens = np.zeros(len(rows), np.int32)
    seq_lens[index] = starts + counts
    # pages holding each row's context (a multi-step decode's: after its last step)
    used = -(-(starts + [s.num_computed for _, s in real]) // page_size)
    page_table = np.zeros((groups, len(rows), max_pages_per_seq), np.int32)
    for (r, s), u in zip(real, used.tolist()):   # a numpy copy a row (sequence.PageTable)
        for g, table in enumerate(s.seq.page_tables):
            page_table[g, r, :u] = table.array()[:u]
    num_real = int(qsl[-1])
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    tokens[:num_real] = list(itertools.chain.from_iterable(queries))
    positions[:num_real] = _ranges(starts, counts)
    lora_slots = np.zeros(t, np.int32)
    lora_slots[:num_real] = np.repeat([s.seq.lora_slot for _, s in real], counts)
    pages = page_table[:, np.repeat(index, counts), positions[:num_real] // page_size]
    slots = np.full((groups, t), num_pages * page_size, np.int32)  # padding: not written
    slots[:, :num_real] = pages * page_size + positions[:num_real] % page_size
    page_table, slots = drop_lone_group(page_table), drop_lone_group(slots)
    # A row sampling k tokens: its last k positions, and its sequence k times.
    logits_index = np.zeros(sd * dq, np.int32)  # sampled positions first
    logits_index[:sampled.sum()] = _ranges(cursors + counts - sampled, sampled)
    sampling_seqs = [s.seq for _, s in real for _ in range(s.num_sampled)]
    ends = (cursors + counts - 1).tolist()
    # A PENDING input (sampled by the step still running) is only ever a row's last token.
    pending = [(end, s.seq) for (_, s), query, end in zip(real, queries, ends) if query[-1] == PENDING]
    first_tokens = [(s, c) for (_, s), c in zip(real, cursors.tolist())]
    arrays = (tokens, positions, slots, page_table, seq_lens, qsl, logits_index)
    return Batch(arrays, sampling_seqs, sp, max_q, dq, prompt_logprobs.pack(first_tokens, t),
                 pooling.pack(first_tokens, t, buckets.ecfg.max_num_seqs), pending, lora_slots)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """range(starts[i], starts[i] + counts[i]) for every i, concatenated."""
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(counts.sum())
