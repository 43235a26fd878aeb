"""Packing: a scheduled ragged batch as one step's bucketed fixed-shape host arrays."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxserve import prompt_logprobs
from jaxserve.buckets import Buckets, StepShape, bucket, cover
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
    pending: list                   # (position in tokens, sequence) of each PENDING input token


def pack(out: SchedulerOutput, buckets: Buckets, max_pages_per_seq: int, num_pages: int,
         page_size: int, ready: frozenset[StepShape] | None = None) -> Batch:
    """The scheduled rows as the step's fixed-shape host arrays (see the runner's docstring):
    prefill rows first, then decode rows (one token, or a verify row's 1 + k) longest context
    first, padded to `buckets` (to the smallest `ready` shape that holds them while warm-up
    builds the others: buckets.cover); decode rows are 1 + k wide only in a step with a verify
    row. A row sampling n tokens has its last n positions in logits_index and its sequence n
    times in sampling_seqs. A PENDING input token (a decode row's token sampled by the step
    still running) is left for the device to read (`pending`)."""
    prefill = [s for s in out.scheduled if s.is_prefill_row]
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
    p = max_pages_per_seq
    rows: list = prefill + [None] * (sp - len(prefill)) + decode + [None] * (sd - len(decode))
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, num_pages * page_size, np.int32)  # padding: not written
    page_table = np.zeros((sp + sd, p), np.int32)
    seq_lens = np.zeros(sp + sd, np.int32)
    qsl = np.zeros(sp + sd + 1, np.int32)
    logits_index = np.zeros(sd * dq, np.int32)  # sampled positions first
    sampling_seqs, starts, pending = [], [], []
    cursor = 0
    for r, s in enumerate(rows):
        if s is not None:
            seq, n = s.seq, s.num_query_tokens
            start = seq.num_computed_tokens
            pos = np.arange(start, start + n)
            pages = np.asarray(seq.page_table, np.int32)
            query = s.query_token_ids
            tokens[cursor:cursor + n] = query
            if query[-1] == PENDING:   # sampled by the step still running: only ever the last
                pending.append((cursor + n - 1, seq))
            positions[cursor:cursor + n] = pos
            slots[cursor:cursor + n] = pages[pos // page_size] * page_size + pos % page_size
            used = -(-(start + n) // page_size)
            page_table[r, :used] = pages[:used]
            seq_lens[r] = start + n
            starts.append((s, cursor))
            cursor += n
            for position in range(cursor - s.num_sampled, cursor):
                logits_index[len(sampling_seqs)] = position
                sampling_seqs.append(seq)
        qsl[r + 1] = cursor
    arrays = (tokens, positions, slots, page_table, seq_lens, qsl, logits_index)
    return Batch(arrays, sampling_seqs, sp, max_q, dq, prompt_logprobs.pack(starts, t), pending)
