"""packing.pack builds a step's arrays at once; checked against a plain row-by-row packing of the
same scheduled batches (tests/scheduler_sim.py's runs: prefill chunks (those without a cached prefix first), decode rows with PENDING
inputs in the overlapped order, verify rows with proposals, forked choices, prefix-cache hits)."""
import numpy as np
import pytest

from jaxserve.buckets import Buckets
from jaxserve.packing import pack
from jaxserve.sequence import PENDING
from tests.scheduler_sim import add, make, request, run_overlapped, step

NUM_PAGES, PAGE_SIZE = 96, 4


def row_by_row(out, batch):
    """The arrays pack should give for `out`, one row at a time."""
    sp = batch.num_prefill_rows
    rows = len(batch.arrays[3])
    fresh = [s for s in out.scheduled if s.is_prefill_row and s.seq.num_computed_tokens == 0]
    prefill = fresh + [s for s in out.scheduled if s.is_prefill_row and s.seq.num_computed_tokens > 0]
    decode = sorted((s for s in out.scheduled if not s.is_prefill_row), key=lambda s: -s.seq.num_computed_tokens)
    order = prefill + [None] * (sp - len(prefill)) + decode + [None] * (rows - sp - len(decode))
    t, logit_rows = len(batch.arrays[0]), len(batch.arrays[6])
    tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
    slots = np.full(t, NUM_PAGES * PAGE_SIZE, np.int32)
    page_table = np.zeros_like(batch.arrays[3])
    seq_lens, qsl, logits_index = np.zeros(rows, np.int32), np.zeros(rows + 1, np.int32), np.zeros(logit_rows, np.int32)
    sampling, pending, cursor = [], [], 0
    for r, s in enumerate(order):
        if s is not None:
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_query_tokens
            query = (seq.token_ids + seq.proposed_token_ids)[start:start + n]
            for i, token in enumerate(query):
                pos = start + i
                tokens[cursor + i], positions[cursor + i] = token, pos
                slots[cursor + i] = seq.page_table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
            used = -(-(start + n) // PAGE_SIZE)
            page_table[r, :used] = seq.page_table[:used]
            seq_lens[r] = start + n
            if query[-1] == PENDING:
                pending.append((cursor + n - 1, seq.seq_id))
            for pos in range(cursor + n - s.num_sampled, cursor + n):
                logits_index[len(sampling)] = pos
                sampling.append(seq.seq_id)
            cursor += n
        qsl[r + 1] = cursor
    return (tokens, positions, slots, page_table, seq_lens, qsl, logits_index), sampling, pending


@pytest.mark.parametrize("order", ["synchronous, with proposals", "overlapped"])
def test_pack_matches_row_by_row_packing(order):
    sched, runner = make(num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_seqs=8, max_num_batched_tokens=32,
                         prefill_chunk_size=8, max_prefill_seqs=2, speculative={"method": "ngram", "num_tokens": 2})
    buckets, checked = Buckets(sched.cfg), []
    execute = runner.execute

    def pack_then_execute(out):
        batch = pack(out, buckets, NUM_PAGES, NUM_PAGES, PAGE_SIZE)
        arrays, sampling, pending = row_by_row(out, batch)
        for got, want in zip(batch.arrays, arrays, strict=True):
            np.testing.assert_array_equal(got, want)
        assert [seq.seq_id for seq in batch.sampling_seqs] == sampling
        assert [(p, seq.seq_id) for p, seq in batch.pending] == pending
        checked.append((batch.num_prefill_rows, len(pending), batch.decode_q))
        return execute(out)

    runner.execute = pack_then_execute
    shared = list(range(3, 15))   # three full pages that later prompts find in the prefix cache
    for i in range(10):
        add(sched, request(f"r{i}", shared[:(i % 3) * 4] + [(7 * i + j) % 30 + 1 for j in range(3 + 5 * i % 17)],
                           max_tokens=3 + i % 5, n=2 if i % 4 == 0 else 1))
    if order == "overlapped":
        run_overlapped(sched, runner)
    else:
        while sched.has_work():
            step(sched, runner, propose=lambda seq: seq.token_ids[-2:])
    assert any(p for p, _, _ in checked) and any(not p for p, _, _ in checked)   # steps with and without prefill rows
    assert any(n for _, n, _ in checked) == (order == "overlapped")             # PENDING inputs
    assert any(q > 1 for _, _, q in checked) == (order != "overlapped")         # verify rows
