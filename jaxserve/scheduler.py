"""Continuous batching at iteration level: which sequences run the next step, and how many tokens.

Each `schedule()`:
  1. Serves the running sequences, decodes first, then prompts being prefilled: one token per
     decode, the next chunk (at most prefill_chunk_size) per prefill, within
     max_num_batched_tokens. When the pool is out of pages, the lowest-priority, newest running
     sequence not yet scheduled this step is preempted by recompute: its pages are freed,
     num_computed_tokens = 0, and it waits again (in front of later arrivals of its priority),
     to be recomputed as one prefill of prompt + outputs, so its output is unchanged.
  2. Admits waiting sequences in (priority, arrival) order while max_num_seqs, the token budget
     and free pages allow; a long prompt's first chunk rides along with the running decodes.
     The first waiting sequence that does not get pages stops admission (no overtaking), and
     a step that preempted admits nothing.

LoRA adapters (seq.lora): the running sequences use at most max_loras distinct ones, one device
slot each. A waiting sequence of an adapter that is not running waits while max_loras are; behind
it, the step admits no sequence of an adapter, not even of a running one (whose later arrivals
would otherwise hold its slot forever and starve the waiting adapter), but base-model sequences
and forks (their request runs) still join. Preemption only removes sequences: the bound holds.

admission_eagerness e in [0, 1]: while any sequence is running (after step 1), the sequences
admitted in this step together take at most floor(e * max_num_batched_tokens) tokens, and never
more than step 1 left. With nothing running, admissions may use the whole budget. So e = 1.0
admits into any leftover budget, and e = 0.0 admits only into an empty batch (static batching:
a group is admitted, prefilled and decoded to completion before the next one starts). The cap
holds for first chunks only; an admitted prompt's later chunks are served in step 1.

n > 1: a request's choices arrive as Sequences with the same request_id, index 0..n-1. Choice 0
is prefilled alone; the others wait until it is running with all prompt tokens but the last
computed. Then each is forked from it when admitted: it shares choice 0's pages of the first
prompt_len - 1 tokens (refcounts) and computes the last prompt token itself, which writes into
the shared last page through copy-on-write, and samples independently. If choice 0 finished
before a sibling could be admitted, or released sliding-window pages the sibling would read
(jaxserve/kv_groups.py), the sibling is prefilled normally (prefix cache helps).
Forks are exempt from the admission_eagerness cap: their request is already admitted.

Rows: each scheduled row brings num_query_tokens tokens and has num_sampled tokens sampled from
its last positions:
  * a prefill chunk: n known tokens in, 1 sampled if it reaches the last known token, else 0;
  * a decode: the last known token in, 1 sampled;
  * a verify row: a running sequence whose tokens are all computed but the last, with proposals
    (seq.proposed_token_ids): the last known token and k proposals in, k+1 sampled. k is cut to
    the token budget and to max_tokens (a step yields at most k+1 tokens, so proposals past
    max_tokens - 1 are useless and would take pages the request was not checked for).
A verify row is not a prefill: it is not capped by max_prefill_seqs.
  * a multi-step decode (`schedule(decode_steps=k)`, k > 1, asked for by the engine when nothing
    waits to prefill): a decode that the device runs num_steps times, each step's sampled token
    the next one's input, so num_steps tokens are computed and sampled. num_steps is k cut to
    max_tokens and max_model_len, to where min_tokens' ban of the ending tokens lifts (the
    sampler's arrays hold for a whole run), and to 1 when the pool lacks the pages for k tokens
    (a row is never preempted for tokens ahead). Tokens after a stop are dropped when collected,
    as with a stop found late.

A step's life: `schedule` plans it; `launched` (once its computations are on their way) advances
each row's computed tokens and gives each sampling row a PENDING output token (a multi-step
decode num_steps of them), so the next step
can be planned while this one runs (a decode row's input is then the PENDING token, read on the
device); `resolve` (its results are back) puts the accepted tokens (1..num_sampled) in place of
the PENDING one, rolls the K/V of rejected proposals back (BlockManager.rollback) and registers
newly full pages in the prefix cache. A sequence is not scheduled while its outputs (PENDING ones
included) reach max_tokens or its tokens max_model_len: its last token is on the way.
"""
from __future__ import annotations

import bisect
import dataclasses

from jaxserve.config import EngineConfig
from jaxserve.block_manager import NO_HIT, BlockManager, sequence_pages
from jaxserve.sequence import PENDING, Sequence, SequenceStatus


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    num_query_tokens: int   # query_token_ids run this step, from position seq.num_computed_tokens
    num_sampled: int        # tokens sampled, at the row's last num_sampled positions
    start: int = 0          # seq.num_computed_tokens when scheduled (the row's first position)
    num_steps: int = 1      # > 1: a multi-step decode (see Rows above)

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V the row writes."""
        return self.num_query_tokens + self.num_steps - 1

    @property
    def is_prefill(self) -> bool:
        """Computes known tokens it samples nothing from (decode and verify rows sample at every
        query position)."""
        return self.num_sampled < self.num_query_tokens

    @property
    def is_prefill_row(self) -> bool:
        """Packed as a prefill row (and under sequence parallelism run on its own): a prefill
        chunk of more than one token. One-token chunks and verify rows ride as decode rows."""
        return self.is_prefill and self.num_query_tokens > 1

    @property
    def query_token_ids(self) -> list[int]:
        """Its tokens from prompt, outputs and proposals, sliced without joining them whole
        (a per-row cost of every step)."""
        seq, start = self.seq, self.seq.num_computed_tokens
        end = start + self.num_query_tokens
        return seq.token_range(start, end) + seq.proposed_token_ids[:max(end - seq.num_tokens, 0)]


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    # (src_page, dst_page) copy-on-write copies to apply before the step's K/V writes, all at
    # once, reading every src before writing any dst (pages.at[dsts].set(pages[srcs])): a src
    # released by its copy may be reused later in the step. The dst pages are distinct.
    page_copies: list[tuple[int, int]]
    preempted: list[Sequence]

    @property
    def num_prefill_seqs(self) -> int:
        return sum(s.is_prefill for s in self.scheduled)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)

    @property
    def decode_steps(self) -> int:
        """Steps the device runs (> 1: a multi-step decode; rows may stop sooner)."""
        return max((s.num_steps for s in self.scheduled), default=1)


def _order(seq: Sequence):
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, engine_cfg: EngineConfig, block_manager: BlockManager, max_model_len: int | None = None):
        if not 0.0 <= engine_cfg.admission_eagerness <= 1.0:
            raise ValueError(f"admission_eagerness must be in [0, 1], got {engine_cfg.admission_eagerness}")
        self.cfg = engine_cfg
        self.bm = block_manager
        self.max_model_len = max_model_len or engine_cfg.max_model_len
        self.waiting: list[Sequence] = []    # sorted by _order
        self.running: list[Sequence] = []    # sorted by _order; the last one is preempted first
        self.requests: dict[str, list[Sequence]] = {}
        self.num_preemptions = 0

    # ---- counters for metrics ----
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def page_usage(self) -> float:
        return self.bm.usage

    @property
    def prefix_hit_rate(self) -> float:
        return self.bm.prefix_hit_rate

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefills_next(self) -> bool:
        """Whether the next step has prompt tokens to compute: a running sequence's prompt not
        all computed, or a waiting sequence with a free seat to take."""
        return (any(s.num_tokens - s.num_computed_tokens > 1 for s in self.running)
                or bool(self.waiting) and len(self.running) < self.cfg.max_num_seqs)

    # ---- requests ----
    def add(self, seq: Sequence) -> None:
        if not seq.prompt_token_ids:
            raise ValueError(f"request {seq.request_id}: empty prompt")
        # The last sampled token is never written to the cache.
        need = sequence_pages(self.bm.windows, self.bm.page_size, seq.num_prompt_tokens + max(seq.sampling.max_tokens, 1) - 1,
                              self.cfg.max_num_batched_tokens)
        if need > self.bm.num_pages - self.bm.reserved:
            raise ValueError(
                f"request {seq.request_id}: {seq.num_prompt_tokens} prompt tokens + max_tokens="
                f"{seq.sampling.max_tokens} need {need} KV pages of {self.bm.page_size} tokens, but the "
                f"pool has {self.bm.num_pages}; shorten the prompt or lower max_tokens")
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)
        self.requests.setdefault(seq.request_id, []).append(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        aborted = [s for s in self.requests.get(request_id, []) if not s.is_finished]
        for seq in aborted:
            self.finish(seq, "abort")
        return aborted

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        (self.running if seq.status is SequenceStatus.RUNNING else self.waiting).remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if all(s.is_finished for s in self.requests[seq.request_id]):
            del self.requests[seq.request_id]

    # ---- one step ----
    def schedule(self, decode_steps: int = 1) -> SchedulerOutput:
        """The next step; `decode_steps` > 1 makes its decodes multi-step (see Rows above)."""
        out = SchedulerOutput([], [], [])
        scheduled_ids = set()
        budget = self.cfg.max_num_batched_tokens

        # 1. Running sequences: decodes first (stable sort keeps priority order within each group).
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_computed_tokens > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING or self._at_limit(seq):   # preempted in this loop
                continue
            row = self._row(seq, budget)
            if row.is_prefill and out.num_prefill_seqs >= self.cfg.max_prefill_seqs:
                continue                                     # the runner's prefill rows are full
            if (decode_steps > 1 and self._reserve_steps(row, decode_steps, out)
                    or self._reserve_or_preempt(seq, row.num_query_tokens, scheduled_ids, out)):
                out.scheduled.append(row)
                scheduled_ids.add(seq.seq_id)
                budget -= row.num_query_tokens

        # 2. Waiting sequences; none after a preemption, which would only take its pages back.
        if out.preempted:
            return out
        cap = int(self.cfg.admission_eagerness * self.cfg.max_num_batched_tokens)
        admit_budget = min(budget, cap) if self.running else budget
        loras = {s.lora for s in self.running if s.lora is not None} if self.cfg.serves_lora else set()
        lora_waits = False   # a sequence waits for an adapter's slot (see LoRA adapters above)
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.cfg.max_num_seqs:
                break
            first = self._first_choice(seq)
            if first is not None and first.status is not SequenceStatus.FINISHED:
                if first.status is SequenceStatus.WAITING or first.num_computed_tokens < seq.num_prompt_tokens - 1:
                    continue                                 # wait for choice 0's prefill
            if first is not None and first.status is not SequenceStatus.FINISHED and self.bm.fork(
                    first, seq, seq.num_prompt_tokens - 1):
                n = 1
                copies = self.bm.reserve(seq, n)
                if copies is None:
                    self.bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                out.page_copies += copies
            else:
                if seq.lora is not None and (lora_waits or seq.lora not in loras and len(loras) >= self.cfg.lora_slots):
                    lora_waits = True
                    continue                                 # base-model sequences behind may still join
                if admit_budget == 0 or out.num_prefill_seqs >= self.cfg.max_prefill_seqs:
                    continue                                 # forks behind may still join
                # Cached pages have no hidden states to score or pool the prompt with (its pages
                # are still cached for others).
                hit = (self.bm.match_prefix(seq.token_ids, seq.sampling.cache_salt, seq.lora_id)
                       if not seq.needs_prompt_hidden_states else NO_HIT)
                n = min(seq.num_tokens - hit.num_tokens, self.cfg.prefill_chunk_size, admit_budget)
                if not self.bm.admit(seq, hit, n):
                    break
                copies = self.bm.reserve(seq, n)   # a partial page among the hit: copied before it is written
                if copies is None:
                    self.bm.free(seq)
                    seq.num_computed_tokens = 0
                    break
                out.page_copies += copies
                admit_budget -= n
            budget -= n
            admit_budget = min(admit_budget, budget)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order)
            if seq.lora is not None:
                loras.add(seq.lora)
            out.scheduled.append(ScheduledSeq(seq, n, int(seq.num_computed_tokens + n == seq.num_tokens),
                                              seq.num_computed_tokens))
            scheduled_ids.add(seq.seq_id)
        return out

    def launched(self, output: SchedulerOutput) -> None:
        """The step is on its way: advance computed tokens; each sampling row gets a PENDING output."""
        for s in output.scheduled:
            s.seq.num_computed_tokens += s.num_computed
            if s.num_sampled:
                s.seq.output_token_ids += [PENDING] * s.num_steps

    def resolve(self, output: SchedulerOutput, accepted: dict[int, list[int]]) -> None:
        """The step's results: each sampling row's accepted tokens (seq_id -> 1..num_sampled, or a
        multi-step decode's num_steps) take the place of its PENDING outputs (the first: a later
        step's may follow), rejected proposals' K/V are rolled back and the full pages this step
        computed enter the prefix cache. A
        sequence finished meanwhile is skipped; one preempted meanwhile keeps its tokens."""
        for s in output.scheduled:
            seq = s.seq
            seq.proposed_token_ids = []
            if seq.is_finished:                                  # aborted or stopped meanwhile
                continue
            rejected = 0
            if s.num_sampled:
                tokens = accepted[seq.seq_id]
                if not (1 <= len(tokens) <= s.num_sampled if s.num_steps == 1 else len(tokens) == s.num_steps):
                    raise ValueError(f"{len(tokens)} accepted tokens from a row sampling {s.num_sampled} "
                                     f"in {s.num_steps} steps")
                i = seq.num_known_outputs
                seq.output_token_ids[i:i + s.num_steps] = tokens
                rejected = s.num_sampled - len(tokens) if s.num_steps == 1 else 0
            if seq.status is SequenceStatus.RUNNING:
                if rejected:
                    self.bm.rollback(seq, rejected)
                self.bm.cache_full_pages(seq, s.start + s.num_computed - rejected)

    # ---- internals ----
    def _row(self, seq: Sequence, budget: int) -> ScheduledSeq:
        """The next row of a running sequence within `budget` tokens (see Rows above)."""
        known = seq.num_tokens - seq.num_computed_tokens
        if known == 1 and seq.proposed_token_ids:
            left = seq.sampling.max_tokens - len(seq.output_token_ids)
            n = min(1 + len(seq.proposed_token_ids), left, budget)
            return ScheduledSeq(seq, n, n, seq.num_computed_tokens)
        n = min(known, self.cfg.prefill_chunk_size, budget)
        return ScheduledSeq(seq, n, int(n == known), seq.num_computed_tokens)

    def _at_limit(self, seq: Sequence) -> bool:
        """Its last output is PENDING: nothing more to compute (the collection finishes it)."""
        return (len(seq.output_token_ids) >= max(seq.sampling.max_tokens, 1)
                or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len))

    def _first_choice(self, seq: Sequence) -> Sequence | None:
        if seq.index == 0:
            return None
        return next((s for s in self.requests[seq.request_id] if s.index == 0), None)

    def _reserve_steps(self, row: ScheduledSeq, decode_steps: int, out: SchedulerOutput) -> bool:
        """Make a decode `row` multi-step if its limits and the free pages allow (see Rows above)."""
        seq = row.seq
        if row.num_query_tokens != 1 or row.num_sampled != 1 or seq.proposed_token_ids or not seq.output_token_ids:
            return False
        steps = min(decode_steps, max(seq.sampling.max_tokens, 1) - len(seq.output_token_ids))
        if seq.end_token_ids and len(seq.output_token_ids) < seq.sampling.min_tokens:   # the ban lasts a run
            steps = min(steps, seq.sampling.min_tokens - len(seq.output_token_ids))
        if self.max_model_len is not None:
            steps = min(steps, self.max_model_len - seq.num_tokens)
        if steps < 2 or (copies := self.bm.reserve(seq, steps)) is None:
            return False
        out.page_copies += copies
        row.num_steps = steps
        return True

    def _reserve_or_preempt(self, seq: Sequence, n: int, scheduled_ids: set[int], out: SchedulerOutput) -> bool:
        """Pages for seq's next n tokens, preempting from the back of the running queue until they
        fit. False when seq itself had to be preempted."""
        while (copies := self.bm.reserve(seq, n)) is None:
            victim = next(s for s in reversed(self.running) if s.seq_id not in scheduled_ids)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        out.page_copies += copies
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_order)
        self.num_preemptions += 1
