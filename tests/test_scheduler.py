"""Scheduler tests against a simulated model (tests/scheduler_sim.py): a wrong page table, a
missed copy-on-write copy or a lost page changes the outputs, which are compared with the same
model run directly on the token lists, one request at a time."""
import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Sequence, SequenceStatus
from tests.scheduler_sim import (VOCAB, add, assert_all_pages_back, check_step, decoding, make, next_token, reference,
                                 request, resolve, run, run_overlapped, step)


def test_chunked_prefill_rides_along_with_decodes():
    sched, runner = make(max_num_batched_tokens=10, prefill_chunk_size=8)
    (a,) = add(sched, request("a", [5, 6, 7], max_tokens=8))
    step(sched, runner)
    step(sched, runner)
    (b,) = add(sched, request("b", range(1, 21), max_tokens=2))
    chunks = []
    while not b.output_token_ids:
        out = step(sched, runner)
        assert [s.seq for s in out.scheduled][0] is a     # a's decode keeps running in every step
        chunks += [(s.num_query_tokens, s.num_sampled) for s in out.scheduled if s.seq is b]
    assert chunks == [(8, False), (8, False), (4, True)]
    run(sched, runner)
    assert a.output_token_ids == reference([5, 6, 7], 8) and b.output_token_ids == reference(range(1, 21), 2)
    assert_all_pages_back(sched)


def test_budgets_hold_under_load_and_priorities_order_admission():
    sched, runner = make(max_num_seqs=3, max_num_batched_tokens=12, prefill_chunk_size=5)
    batch = [add(sched, request(f"b{i}", [i + 1] * 7, max_tokens=5, priority=1, arrival=i))[0] for i in range(4)]
    online = [add(sched, request(f"o{i}", [i + 9] * 6, max_tokens=5, priority=0, arrival=10 + i))[0] for i in range(4)]
    first = sched.schedule()
    assert [s.seq for s in first.scheduled] == online[:3]     # later arrivals, but online first
    resolve(sched, first, runner.execute(first))
    admitted = list(online[:3])
    for out in run(sched, runner):
        admitted += [s.seq for s in out.scheduled if s.seq not in admitted]
    assert admitted.index(online[3]) < min(admitted.index(b) for b in batch)
    for seq in batch + online:
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 5)
    assert_all_pages_back(sched)


def test_preemption_takes_newest_lowest_priority_and_recomputes():
    # 6 pages of 2 tokens; three sequences of 3-token prompts growing to 9 tokens cannot all fit.
    sched, runner = make(num_pages=6, page_size=2, max_num_seqs=4, max_num_batched_tokens=16,
                         enable_prefix_caching=False)
    old_batch = add(sched, request("old-batch", [1, 2, 3], max_tokens=8, priority=1, arrival=0))[0]
    online1 = add(sched, request("online1", [4, 5, 6], max_tokens=8, arrival=1))[0]
    online2 = add(sched, request("online2", [7, 8, 9], max_tokens=8, arrival=2))[0]
    outs = []
    while not any(o.preempted for o in outs):
        outs.append(step(sched, runner))
    assert outs[-1].preempted == [old_batch]                  # batch priority goes first, though oldest
    assert old_batch.status is SequenceStatus.WAITING and old_batch.num_computed_tokens == 0
    while len(preempted := [s for o in outs for s in o.preempted]) < 2:
        assert sched.has_work()
        outs.append(step(sched, runner))
    assert preempted[:2] == [old_batch, online2]              # then the newest online one
    outs += run(sched, runner)
    recomputed = [s for o in outs for s in o.scheduled if s.seq is old_batch and s.num_query_tokens > 1]
    assert recomputed and recomputed[-1].num_sampled               # prompt + outputs recomputed in one prefill
    for seq in (old_batch, online1, online2):
        assert seq.output_token_ids == reference(seq.prompt_token_ids, 8)
    assert sched.num_preemptions == len(preempted) >= 2
    assert_all_pages_back(sched)


@pytest.mark.parametrize("eagerness", [0.0, 0.5, 1.0])
def test_admission_eagerness(eagerness):
    sched, runner = make(max_num_batched_tokens=16, prefill_chunk_size=16, admission_eagerness=eagerness)
    (a,) = add(sched, request("a", [1, 2], max_tokens=6))
    step(sched, runner)
    (b,) = add(sched, request("b", range(3, 23), max_tokens=2))
    out = step(sched, runner)
    b_chunks = [s.num_query_tokens for s in out.scheduled if s.seq is b]
    if eagerness == 0.0:
        assert not b_chunks and b.status is SequenceStatus.WAITING
        while not a.is_finished:
            assert b.status is SequenceStatus.WAITING
            step(sched, runner)
    else:
        assert b_chunks == [min(15, int(eagerness * 16))]
    run(sched, runner)
    assert a.output_token_ids == reference([1, 2], 6) and b.output_token_ids == reference(range(3, 23), 2)
    assert_all_pages_back(sched)


@pytest.mark.parametrize("prompt_len, copies", [(10, 2), (9, 0)])
def test_n_choices_fork_from_the_first_with_copy_on_write(prompt_len, copies):
    sched, runner = make(page_size=4)
    prompt = list(range(1, prompt_len + 1))
    seqs = add(sched, request("r", prompt, max_tokens=6, n=3))
    out = step(sched, runner)
    assert [(s.seq, s.num_query_tokens) for s in out.scheduled] == [(seqs[0], prompt_len)]
    out = sched.schedule()
    check_step(sched, out)
    forks = [s for s in out.scheduled if s.seq is not seqs[0]]
    assert [(s.seq, s.num_query_tokens, s.num_sampled) for s in forks] == [(seqs[1], 1, True), (seqs[2], 1, True)]
    shared = (prompt_len - 1) // 4                            # full pages all three share
    assert seqs[1].page_table[:shared] == seqs[2].page_table[:shared] == seqs[0].page_table[:shared]
    assert all(sched.bm.ref_counts[p] == 3 for p in seqs[0].page_table[:shared])
    last = seqs[0].page_table[shared] if copies else None     # the partial page holding token prompt_len - 2
    assert out.page_copies == [(last, seqs[1].page_table[shared]), (last, seqs[2].page_table[shared])][:copies]
    resolve(sched, out, runner.execute(out))
    run(sched, runner)
    outputs = [s.output_token_ids for s in seqs]
    assert outputs == [reference(prompt, 6, i) for i in range(3)]
    assert len({tuple(o) for o in outputs}) == 3              # choices sample independently
    assert_all_pages_back(sched)


def test_abort_frees_everything():
    sched, runner = make(max_num_batched_tokens=8, prefill_chunk_size=8)
    keep = add(sched, request("keep", [1, 2, 3], max_tokens=10))[0]
    gone = add(sched, request("gone", range(1, 30), max_tokens=10, n=2))
    step(sched, runner)
    step(sched, runner)
    assert gone[0].page_table and gone[1].status is SequenceStatus.WAITING
    assert sched.abort("gone") == gone
    assert all(s.is_finished and s.finish_reason == "abort" and not s.page_table for s in gone)
    assert sched.abort("gone") == [] and sched.abort("never-seen") == []
    run(sched, runner)
    assert keep.output_token_ids == reference([1, 2, 3], 10)
    assert_all_pages_back(sched)


def test_add_rejects_a_request_that_can_never_fit():
    sched, _ = make(num_pages=4, page_size=4)
    (fits,) = request("ok", range(10), max_tokens=7)          # 16 tokens with K/V: exactly 4 pages
    sched.add(fits)
    with pytest.raises(ValueError, match="KV pages"):
        sched.add(request("big", range(10), max_tokens=8)[0])
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add(request("empty", [], max_tokens=1)[0])


def test_prefix_cache_serves_a_repeated_prompt():
    sched, runner = make(page_size=4, prefill_chunk_size=64)
    prompt = list(range(1, 15))
    (a,) = add(sched, request("a", prompt, max_tokens=3))
    run(sched, runner)
    (b,) = add(sched, request("b", prompt, max_tokens=3))
    out = step(sched, runner)
    assert out.scheduled[0].num_query_tokens == 14 - 12          # three full pages came from the cache
    assert sched.prefix_hit_rate == 12 / 28
    run(sched, runner)
    assert a.output_token_ids == b.output_token_ids == reference(prompt, 3)
    assert_all_pages_back(sched)


def test_multi_step_decodes_take_only_free_pages():
    """decode_steps 4 with 2 pages free: the first row takes them for its 4 tokens ahead, the second
    runs one step in its own last page; nobody is preempted for tokens ahead. Then each runs to
    its max_tokens (a run cut to the tokens left) with the reference outputs."""
    sched, runner = make(num_pages=6, page_size=2, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = (add(sched, request(rid, prompt, max_tokens=7))[0] for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])))
    decoding(sched, runner, a, b)   # 2 pages each: 3 prompt tokens and the first output's slot
    out = sched.schedule(decode_steps=4)
    assert [(s.seq, s.num_steps) for s in out.scheduled] == [(a, 4), (b, 1)] and not out.preempted
    assert sched.bm.num_free_pages == 0
    resolve(sched, out, runner.execute(out))
    while sched.has_work():
        step(sched, runner, decode_steps=4)
    assert a.output_token_ids == reference([1, 2, 3], 7) and b.output_token_ids == reference([4, 5, 6], 7)
    assert_all_pages_back(sched)



def test_multi_step_runs_end_where_min_tokens_ban_lifts():
    """min_tokens 7 with an ending token: the sampler bans it for a whole run, so a run of 4 is cut
    to end at the 7th output; then whole runs, the last cut to max_tokens (1 left: one step)."""
    sched, runner = make(max_num_seqs=1, max_num_batched_tokens=16)
    sp = SamplingParams(max_tokens=16, min_tokens=7, stop_token_ids=[VOCAB])   # never sampled here
    (a,) = add(sched, [Sequence(request_id="a", prompt_token_ids=[1, 2, 3], sampling=sp, arrival_time=0.0,
                                end_token_ids=(VOCAB,))])
    decoding(sched, runner, a)
    runs = []
    while sched.has_work():
        runs += [s.num_steps for s in step(sched, runner, decode_steps=4).scheduled]
    assert runs == [4, 2, 4, 4, 1]
    assert a.output_token_ids == reference([1, 2, 3], 16)
    assert_all_pages_back(sched)

BASES = [list(range(1, 13)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


@st.composite
def workloads(draw):
    page_size = draw(st.integers(1, 4))
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(BASES))[:draw(st.integers(0, 12))] + draw(st.lists(st.integers(1, 9), max_size=6))
        reqs.append(dict(rid=f"r{i}", prompt=prompt or [1], max_tokens=draw(st.integers(1, 8)),
                         n=draw(st.integers(1, 3)), priority=draw(st.integers(0, 1)),
                         arrive=draw(st.integers(0, 6)), abort=draw(st.none() | st.integers(0, 12)),
                         stop=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)), min_tokens=draw(st.integers(0, 6)),
                         lora=draw(st.sampled_from([None, 0, 1, 2]))))
    need = max(-(-(len(r["prompt"]) + r["max_tokens"] - 1) // page_size) for r in reqs)
    cfg = dict(num_pages=draw(st.integers(need, need + 4)), page_size=page_size,
               max_num_seqs=draw(st.integers(1, 6)), max_num_batched_tokens=draw(st.integers(1, 24)),
               prefill_chunk_size=draw(st.integers(1, 12)), enable_prefix_caching=draw(st.booleans()),
               admission_eagerness=draw(st.sampled_from([0.0, 0.3, 1.0])), enable_lora=True,
               max_loras=draw(st.integers(1, 2)))
    spec = draw(st.none() | st.tuples(st.integers(1, 4), st.integers(0, 2**16)))   # (k, proposer seed)
    cfg["decode_steps"] = 1 if spec else draw(st.sampled_from([1, 2, 3, 5]))   # they do not combine
    return cfg, reqs, spec


def proposer(k, seed):
    """Up to k tokens of the reference continuation, some swapped: verify rows accept 0..k."""
    rng = random.Random(seed)

    def propose(seq):
        context, out = list(seq.token_ids), []
        for _ in range(rng.randint(0, k)):
            out.append(next_token(context, seq.index) if rng.random() < 0.7 else rng.randrange(VOCAB))
            context.append(out[-1])
        return out
    return propose


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_random_workloads_finish_with_reference_outputs_and_free_pages(workload):
    cfg, reqs, spec = workload
    sched, runner = make(**cfg)
    propose = proposer(*spec) if spec else None
    seqs, t, adapters = {}, 0, [Adapter(i) for i in range(3)]
    while sched.has_work() or any(r["arrive"] >= t for r in reqs):
        for r in reqs:
            if r["arrive"] == t:
                seqs[r["rid"]] = request(r["rid"], r["prompt"], r["max_tokens"], r["n"], r["priority"], t,
                                         stop=r["stop"], min_tokens=r["min_tokens"])
                for seq in seqs[r["rid"]]:
                    seq.lora = None if r["lora"] is None else adapters[r["lora"]]
                add(sched, seqs[r["rid"]])
            if r["abort"] == t and r["rid"] in seqs:
                sched.abort(r["rid"])
        step(sched, runner, propose, cfg["decode_steps"])
        assert len({s.lora for s in sched.running} - {None}) <= cfg["max_loras"]
        t += 1
        assert t < 5_000, "scheduler made no progress"
    for r in reqs:
        for seq in seqs[r["rid"]]:
            assert seq.is_finished
            want = reference(r["prompt"], r["max_tokens"], seq.index, r["stop"])
            if seq.finish_reason == "abort":
                assert want[:len(seq.output_token_ids)] == seq.output_token_ids
            else:
                assert seq.output_token_ids == want
    assert_all_pages_back(sched)


def test_verify_rows_bring_k_plus_1_tokens_sample_all_and_are_not_prefills():
    sched, runner = make(max_num_batched_tokens=32, max_prefill_seqs=1, page_size=4)
    a, b = add(sched, request("a", [3, 1, 4], max_tokens=9) + request("b", [2, 7], max_tokens=9))
    decoding(sched, runner, a, b)
    want_a, want_b = reference([3, 1, 4], 9), reference([2, 7], 9)
    (c,) = add(sched, request("c", range(1, 11), max_tokens=2))
    a.proposed_token_ids = want_a[len(a.output_token_ids):][:3]                 # all right
    b.proposed_token_ids = [want_b[len(b.output_token_ids)], VOCAB - 1 - want_b[len(b.output_token_ids) + 1], 0]
    a_len, b_len = a.num_tokens, b.num_tokens
    check_step(sched, out := sched.schedule())
    rows = {s.seq.request_id: (s.num_query_tokens, s.num_sampled, s.is_prefill) for s in out.scheduled}
    assert rows == {"a": (4, 4, False), "b": (4, 4, False), "c": (10, 1, True)}   # max_prefill_seqs=1 holds
    assert out.num_prefill_seqs == 1 and out.num_tokens == 18
    assert len(b.page_table) == sched.bm.pages_for(b_len + 3)                      # pages for the proposals
    resolve(sched, out, runner.execute(out))
    assert a.num_tokens == a_len + 4 and b.num_tokens == b_len + 2                 # 3 + 1 and 1 + 1 tokens
    assert b.num_computed_tokens == b.num_tokens - 1 and len(b.page_table) == sched.bm.pages_for(b.num_tokens - 1)
    run(sched, runner)
    assert (a.output_token_ids, b.output_token_ids) == (want_a, want_b)
    assert c.output_token_ids == reference(range(1, 11), 2)
    assert_all_pages_back(sched)


def test_verify_rows_are_cut_to_the_token_budget_and_max_tokens():
    sched, runner = make(max_num_batched_tokens=4, page_size=4)
    a, b = add(sched, request("a", [5], max_tokens=3) + request("b", [6], max_tokens=8))
    decoding(sched, runner, a, b)
    a.proposed_token_ids = b.proposed_token_ids = [1, 2, 3, 4, 5]
    check_step(sched, out := sched.schedule())
    # a has 2 tokens to go: 1 proposal is all a step can use; b gets what is left of the budget.
    assert [(s.seq, s.num_query_tokens, s.num_sampled) for s in out.scheduled] == [(a, 2, 2), (b, 2, 2)]
    resolve(sched, out, runner.execute(out))
    run(sched, runner)
    assert (a.output_token_ids, b.output_token_ids) == (reference([5], 3), reference([6], 8))
    assert_all_pages_back(sched)


def test_overlapped_order_gives_the_same_outputs_and_all_pages_back():
    """Steps planned while the previous one runs (PENDING inputs read from its results, stops
    found one step late), with copy-on-write forks, prefix hits, preemption and stop tokens."""
    sched, runner = make(num_pages=14, page_size=2, max_num_seqs=4, max_num_batched_tokens=12, prefill_chunk_size=5)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 8], [9, 10, 11], [12] * 9]
    reqs = [add(sched, request(f"r{i}", p, max_tokens=6 + i, n=1 + i % 2, arrival=i, stop=(3, 7)))
            for i, p in enumerate(prompts)]
    run_overlapped(sched, runner)
    assert sched.num_preemptions > 0
    for seqs in reqs:
        for seq in seqs:
            assert seq.output_token_ids == reference(seq.prompt_token_ids, seq.sampling.max_tokens, seq.index, (3, 7))
    assert_all_pages_back(sched)


def test_prefills_next_says_whether_the_next_step_computes_prompt_tokens():
    """The speculation throttle's question (jaxserve/spec_decode/throttle.py): asked before each
    step, over arrivals, chunked prompts, a full batch (max_num_seqs) and finishing requests."""
    sched, runner = make(max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=4)
    add(sched, request("a", range(1, 10), max_tokens=3))
    arrivals = {2: request("b", [3, 4], max_tokens=6), 3: request("c", range(5, 12), max_tokens=2)}
    answers = []
    for i in range(40):
        add(sched, arrivals.get(i, []))
        if not sched.has_work():
            break
        expected = sched.prefills_next()
        out = step(sched, runner)
        answers.append(expected)
        assert expected == any(s.is_prefill for s in out.scheduled), i
    assert True in answers and False in answers


class Adapter:
    """What the scheduler reads of a jaxserve.lora.Adapter: its identity, and its id (the prefix cache's key)."""

    def __init__(self, id):
        self.id = id


def test_adapters_beyond_max_loras_wait_and_hold_back_adapter_rows_behind_them():
    """max_loras 2: C's request waits while A and B run; base rows behind it are admitted, A's
    newer request waits behind it (else A's arrivals could keep C out); C runs once A is done."""
    sched, runner = make(enable_lora=True, max_loras=2, max_num_batched_tokens=64, prefill_chunk_size=16,
                         max_prefill_seqs=8)
    a, b, c = (Adapter(i) for i in range(3))
    order = [("a1", a, 3), ("b1", b, 8), ("c1", c, 4), ("base", None, 4), ("a2", a, 4)]
    seqs = {}
    for t, (rid, adapter, max_tokens) in enumerate(order):
        (seqs[rid],) = request(rid, [t + 1] * 5, max_tokens=max_tokens, arrival=t)
        seqs[rid].lora = adapter
        add(sched, [seqs[rid]])
    admitted = [s.seq.request_id for s in step(sched, runner).scheduled]
    assert admitted == ["a1", "b1", "base"]
    while sched.has_work():
        out = step(sched, runner)
        admitted += [s.seq.request_id for s in out.scheduled if s.seq.request_id not in admitted]
        assert len({s.lora for s in sched.running} - {None}) <= 2
    assert admitted == ["a1", "b1", "base", "c1", "a2"]
    for t, (rid, _, max_tokens) in enumerate(order):
        assert seqs[rid].output_token_ids == reference([t + 1] * 5, max_tokens)
    assert_all_pages_back(sched)
