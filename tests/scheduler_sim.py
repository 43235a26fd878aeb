"""The scheduler tests' simulated model (tests/test_scheduler.py), and the engine's step orders
driven on it.

The fake runner keeps a pool of pages holding, per slot, the token whose K/V were written there.
It writes each step's tokens through the page table (after the copy-on-write copies) and
"samples" the next token from the context it reads back through the page table, so a wrong page
table, a missed copy or a lost page changes the output. Outputs are compared with the same
deterministic model run directly on the token lists, one request at a time.
"""
from jaxserve.block_manager import BlockManager
from jaxserve.config import EngineConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler
from jaxserve.sequence import PENDING, Sequence, SequenceStatus

VOCAB = 37


def next_token(context, index):
    """The simulated model: a deterministic function of the whole context and the choice index."""
    h = index
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def reference(prompt, max_tokens, index=0, stop=()):
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(next_token(tokens, index))
        tokens.append(out[-1])
        if out[-1] in stop:
            break
    return out


class FakeRunner:
    def __init__(self, bm):
        self.bm = bm
        self.slots = [None] * (bm.num_pages * bm.page_size)
        self.last = {}   # the previous step's results

    def slot(self, seq, pos):
        ps = self.bm.page_size
        return seq.page_table[pos // ps] * ps + pos % ps

    def known(self, seq):
        """seq's tokens, the PENDING ones (the last) read from the previous step's results (as the
        device does)."""
        ids = seq.token_ids
        pending = len(ids) - seq.num_prompt_tokens - seq.num_known_outputs
        return ids[:len(ids) - pending] + self.last[seq.seq_id][:pending] if pending else ids

    def execute(self, out):
        """Writes each row's query tokens, samples at its sampled positions and returns seq_id ->
        accepted tokens: for a verify row, the proposals matching the samples, then the sample
        after them (greedy acceptance), cut after a stop token; for a multi-step decode, its
        num_steps samples, each written through the page table and read back as the next input."""
        ps = self.bm.page_size
        data = [self.slots[s * ps:(s + 1) * ps] for s, _ in out.page_copies]
        for (_, dst), page in zip(out.page_copies, data):
            self.slots[dst * ps:(dst + 1) * ps] = page
        for s in out.scheduled:
            start = s.seq.num_computed_tokens
            query = (self.known(s.seq) + s.seq.proposed_token_ids)[start:start + s.num_query_tokens]
            for pos, token in zip(range(start, start + s.num_query_tokens), query):
                page = s.seq.page_table[pos // ps]
                assert self.bm.ref_counts[page] == 1 and page not in self.bm.page_key, "wrote a shared page"
                self.slots[self.slot(s.seq, pos)] = token
        accepted = {}
        for s in out.scheduled:
            seq, end = s.seq, s.seq.num_computed_tokens + s.num_query_tokens
            context = [self.slots[self.slot(seq, p)] for p in range(end)]
            assert context == (self.known(seq) + seq.proposed_token_ids)[:end], \
                "context read through the page table is wrong"
            tokens = []
            if s.num_steps > 1:   # a multi-step decode
                for k in range(s.num_steps):
                    tokens.append(next_token(context, seq.index))
                    if k + 1 < s.num_steps:   # the next step's input, written and read back
                        page = seq.page_table[(end + k) // ps]
                        assert self.bm.ref_counts[page] == 1 and page not in self.bm.page_key, "wrote a shared page"
                        self.slots[self.slot(seq, end + k)] = tokens[-1]
                        context = [self.slots[self.slot(seq, p)] for p in range(end + k + 1)]
                accepted[seq.seq_id] = tokens
                continue
            for p in range(end - s.num_sampled, end):
                tokens.append(next_token(context[:p + 1], seq.index))
                if p + 1 == end or tokens[-1] != context[p + 1] or tokens[-1] in seq.sampling.stop_token_ids:
                    break
            if tokens:
                accepted[seq.seq_id] = tokens
        self.last = accepted
        return accepted


def make(num_pages=64, page_size=4, **cfg):
    cfg = EngineConfig(page_size=page_size, num_pages=num_pages, **cfg)
    bm = BlockManager(num_pages, page_size, cfg.enable_prefix_caching)
    return Scheduler(cfg, bm), FakeRunner(bm)


def request(rid, prompt, max_tokens=4, n=1, priority=0, arrival=0.0, stop=(), min_tokens=0):
    """A request's sequences. The simulated model ends one at a stop token whatever min_tokens says
    (its reference too); min_tokens only cuts multi-step runs (Scheduler._reserve_steps)."""
    sp = SamplingParams(n=n, max_tokens=max_tokens, priority=priority, stop_token_ids=list(stop),
                        min_tokens=min(min_tokens, max_tokens))
    return [Sequence(request_id=rid, prompt_token_ids=list(prompt), sampling=sp, arrival_time=arrival, index=i,
                     end_token_ids=tuple(stop)) for i in range(n)]


def add(sched, seqs):
    for s in seqs:
        sched.add(s)
    return seqs


def check_step(sched, out):
    cfg = sched.cfg
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert out.num_tokens <= cfg.max_num_batched_tokens
    assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
    assert out.num_prefill_seqs <= cfg.max_prefill_seqs
    for s in out.scheduled:
        known = s.seq.num_tokens - s.seq.num_computed_tokens
        if s.num_steps > 1:   # a multi-step decode: a decode row, its steps within max_tokens, and
            # within min_tokens' ban or after it (the sampler's ban holds for a whole run)
            outputs, p = len(s.seq.output_token_ids), s.seq.sampling
            assert known == s.num_query_tokens == s.num_sampled == 1 and outputs
            assert outputs + s.num_steps <= p.max_tokens
            assert not s.seq.end_token_ids or outputs >= p.min_tokens or outputs + s.num_steps <= p.min_tokens
        if s.num_query_tokens > known:      # a verify row: the last known token and proposals
            assert known == 1 and s.num_sampled == s.num_query_tokens <= 1 + len(s.seq.proposed_token_ids)
            assert not s.is_prefill and len(s.seq.output_token_ids) + s.num_sampled <= s.seq.sampling.max_tokens
        else:
            assert 1 <= s.num_query_tokens <= cfg.prefill_chunk_size
            assert s.num_sampled == (s.seq.num_computed_tokens + s.num_query_tokens == s.seq.num_tokens)
            assert s.is_prefill == (s.num_query_tokens > 1 or not s.num_sampled)
        assert s.seq.status is SequenceStatus.RUNNING
    assert len({d for _, d in out.page_copies}) == len(out.page_copies)
    refs = [0] * sched.bm.num_pages
    for seq in sched.running:
        for p in seq.page_table:
            refs[p] += 1
    assert refs == sched.bm.ref_counts
    assert all(not s.page_table and s.num_computed_tokens == 0 for s in sched.waiting)


def step(sched, runner, propose=None, decode_steps=1):
    """One step; `propose(seq)` (optional) gives proposals to every sequence that can verify;
    `decode_steps` is asked for as the engine does: while every running sequence decodes and no
    prompt waits for a seat."""
    for seq in sched.running:
        if propose and seq.num_computed_tokens == seq.num_tokens - 1:
            seq.proposed_token_ids = propose(seq)
    decodes = not sched.prefills_next() and all(s.output_token_ids for s in sched.running)
    out = sched.schedule(decode_steps if decodes else 1)
    check_step(sched, out)
    resolve(sched, out, runner.execute(out))
    for seq in sched.running:   # no page past the computed tokens, rejected proposals included
        assert len(seq.page_table) == sched.bm.pages_for(seq.num_computed_tokens)
    assert all(not s.seq.proposed_token_ids for s in out.scheduled)
    for s in out.scheduled:
        seq = s.seq
        if s.num_steps > 1:   # the engine's collection: a run is cut after its first stop token
            first = len(seq.output_token_ids) - s.num_steps
            stops = [i for i, t in enumerate(seq.output_token_ids[first:]) if t in seq.sampling.stop_token_ids]
            del seq.output_token_ids[first + stops[0] + 1 if stops else len(seq.output_token_ids):]
        if s.num_sampled and seq.output_token_ids[-1] in seq.sampling.stop_token_ids:
            sched.finish(seq, "stop")
        elif s.num_sampled and len(seq.output_token_ids) == seq.sampling.max_tokens:
            sched.finish(seq, "length")
    return out


def resolve(sched, out, accepted):
    """A step's life in the scheduler, in the synchronous order: launched, then resolved."""
    sched.launched(out)
    sched.resolve(out, accepted)


def finish_late(sched, out, accepted):
    """The overlapped order's collection of `out` (the next step already launched): resolve, then
    stop checks as the engine makes them, dropping a finished sequence's later PENDING token."""
    live = [s for s in out.scheduled if s.num_sampled and not s.seq.is_finished]
    first = {s.seq.seq_id: s.seq.output_token_ids.index(PENDING) for s in live}
    sched.resolve(out, accepted)
    for s in live:
        seq = s.seq
        end = first[seq.seq_id] + 1
        if seq.output_token_ids[end - 1] in seq.sampling.stop_token_ids or end == seq.sampling.max_tokens:
            sched.finish(seq, "stop")
            del seq.output_token_ids[end:]


def run_overlapped(sched, runner, max_steps=10_000):
    """The engine's overlapped loop: step N+1 is planned and run before step N is resolved."""
    inflight, steps = None, 0
    while sched.has_work():
        out = sched.schedule()
        check_step(sched, out)
        accepted = runner.execute(out)
        sched.launched(out)
        if inflight is not None:
            finish_late(sched, *inflight)
        inflight = out, accepted
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    if inflight is not None:
        finish_late(sched, *inflight)


def run(sched, runner, max_steps=10_000):
    outs = []
    while sched.has_work():
        outs.append(step(sched, runner))
        assert len(outs) < max_steps, "scheduler made no progress"
    return outs


def assert_all_pages_back(sched):
    assert sched.bm.num_free_pages == sched.bm.num_pages and sched.bm.num_used_pages == 0
    assert not sched.requests


def decoding(sched, runner, *seqs):
    while any(s.num_computed_tokens != s.num_tokens - 1 or not s.output_token_ids for s in seqs):
        step(sched, runner)
