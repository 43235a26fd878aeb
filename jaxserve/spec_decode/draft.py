"""Draft-model proposer: a smaller model sharing the target's tokenizer guesses each verify row's
proposals, its greedy continuation of the sequence.

Exactness: a greedy draft's proposals are a function of the sequence's tokens, a certain
proposal (q one-hot), so the engine's acceptance rule (the target samples every position, a
proposal is kept while it equals the sample: jaxserve/engine.py, `_accept`) keeps the target's
distribution at any temperature, as for n-gram lookup. Sampling the draft (full q) would accept
more at temperature > 0 but needs q's probabilities in the verify step; not done.

KV: the draft has its own page pool (its own runner, jaxserve/runner.py, one KV group of all the
draft's layers) with the target's num_pages and page_size, addressed by the target's page table
of group 0 (`seq.page_table`): the only one without the hybrid KV cache, a full group's with it
(jaxserve/kv_groups.py: a target whose layers all slide keeps one full group when served with a
draft), whose pages stay until the sequence ends. So the block manager's allocation,
copy-on-write, rollback (bookkeeping only), preemption and freeing serve it as they are; the
target's page copies of each step (every group's) are applied to the draft's pool too. The pages
of the target's sliding groups are unused in the draft's pool. Per sequence the
proposer keeps how many leading tokens have their draft K/V in the pages (`_Written`):
  * at most the target's computed tokens: the pages past them may be gone (rollback, preemption);
  * a new sequence (a prefix-cache hit, an n > 1 fork) and a preempted one start from 0: a page
    shared from the prefix cache holds the target's K/V, not necessarily the draft's. Catching
    up rewrites such a shared page with the values it would hold anyway (same tokens, same
    positions), and every page past the computed tokens that the draft writes was reserved
    (and copied on write) for this step's verify row, so no other sequence's page is changed.

Each engine step with verify rows: the scheduler reserved 1 + n pages' slots per verify row (the
last known token and n placeholder proposals, PENDING); then the draft runs on the host's
tokens, batched over the rows: catch-up chunks (the tokens not yet in the draft's pages, split
as the engine's budget allows: prefill_chunk_size, max_num_batched_tokens, max_prefill_seqs)
ending at the last known token, whose logits give the first proposal, then one-token steps,
each writing the K/V of the proposal before and giving the next; all rows in the same steps (a
short catch-up rides as one-token rows). Every shape is one of the draft runner's warm-up
buckets. The draft writes positions up to start + n - 1, inside the verify row's reservation.
"""
from __future__ import annotations

import dataclasses
import os
import time
import weakref

from jaxserve.checkpoint import load_for_mesh, saved_lm_head, saved_quantization
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.runner import ModelRunner
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.sequence import PENDING, Sequence, SequenceStatus

GREEDY = SamplingParams(temperature=0.0)


def default_draft_dir(target_dir: str, tiny_model_dir: str) -> str:
    """The embedded model's draft checkpoint; other models must name theirs."""
    if os.path.realpath(target_dir) != os.path.realpath(tiny_model_dir):
        raise ValueError("engine config: speculative method draft needs `model` (the draft's directory) "
                         "for a model other than the embedded one")
    return os.path.join(tiny_model_dir, "draft")


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model: its directory, its config, and its weights as the proposer holds them (the
    engine config's quantization and quantize_lm_head, else as its checkpoint was saved)."""
    dir: str
    cfg: ModelConfig
    quantization: str | None
    quantize_lm_head: bool

    def engine_config(self, ecfg: EngineConfig, num_pages: int, max_model_len: int) -> EngineConfig:
        """The draft runner's: the target's buckets (as many prefill rows a draft step as a target
        step: every sequence catches up when speculation resumes after steps the throttle kept
        plain, throttle.py, and each new one), the target's pool size, one KV group (its pool is
        addressed by the target's group-0 page table, a full one: see above)."""
        return dataclasses.replace(ecfg, model=self.dir, speculative=None, num_pages=num_pages,
                                   max_model_len=max_model_len, hybrid_kv_cache=False,
                                   quantize_lm_head=self.quantize_lm_head)


def draft_model(ecfg: EngineConfig, target_dir: str, target_cfg: ModelConfig, tiny_model_dir: str) -> DraftModel | None:
    """The draft model (speculative method draft), or None: read before the target's pool is
    sized, which makes room for the draft's weights and pool (sizing.py). A draft must share the
    target's tokenizer: another vocabulary is refused here, for the engine and `jaxserve check`."""
    spec = ecfg.speculative
    if spec is None or spec.method != "draft":
        return None
    draft_dir = spec.model or default_draft_dir(target_dir, tiny_model_dir)
    cfg = ModelConfig.from_pretrained(draft_dir)
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"engine config: the draft model's vocabulary ({cfg.vocab_size} tokens) is not the "
                         f"target's ({target_cfg.vocab_size}); a draft must share the target's tokenizer")
    return DraftModel(draft_dir, cfg, ecfg.quantization or saved_quantization(draft_dir),
                      ecfg.quantize_lm_head or saved_lm_head(draft_dir))


@dataclasses.dataclass
class _Written:
    """The draft's K/V in a sequence's pages: its first `valid` tokens, then (maybe) `tail`, the
    proposals written after them, right while they equal the tokens the target accepted."""
    valid: int
    tail: list[int]


class DraftProposer:
    def __init__(self, draft: DraftModel, ecfg: EngineConfig, num_pages: int, max_model_len: int, mesh, dtype):
        params = load_for_mesh(draft.dir, draft.cfg, dtype, draft.quantization, mesh, draft.quantize_lm_head)
        self.runner = ModelRunner(draft.cfg, params, draft.engine_config(ecfg, num_pages, max_model_len),
                                  mesh=mesh, dtype=dtype)
        self.num_tokens = ecfg.speculative.num_tokens
        self._written: weakref.WeakKeyDictionary[Sequence, _Written] = weakref.WeakKeyDictionary()

    def warmup(self) -> int:
        return self.runner.warmup()

    def placeholders(self) -> list[int]:
        """A running sequence's proposals before the schedule: the scheduler sizes its verify row
        (and reserves its pages) by them; `propose` fills in those it kept."""
        return [PENDING] * self.num_tokens

    def propose(self, out: SchedulerOutput) -> tuple[int, float]:
        """Before `out` launches: mirror its page copies in the draft's pool, forget what
        preempted sequences had, and replace the placeholder proposals of each verify row by the
        draft's (a row cut to one token keeps none). Returns the draft steps it ran and the
        seconds of those before the last k: catching the draft's K/V up with the tokens (a
        prompt's, a plain step's), a prefill's work, where the last k steps are each verify
        step's own cost."""
        self.runner.copy_pages(out.page_copies)
        for seq in out.preempted:
            self._written.pop(seq, None)
            seq.proposed_token_ids = []
        wanted = {s.seq: s.num_sampled - 1 for s in out.scheduled if s.num_sampled > 1}   # verify rows
        for s in out.scheduled:
            if s.seq not in wanted:
                s.seq.proposed_token_ids = []
        if not wanted:
            return 0, 0.0
        views = {seq: self._view(seq) for seq in wanted}
        steps = []   # their seconds
        while active := [v for seq, v in views.items() if len(v.output_token_ids) < wanted[seq]]:
            start = time.perf_counter()
            self._step(self._rows(active))
            steps.append(time.perf_counter() - start)
        for seq, view in views.items():
            seq.proposed_token_ids = view.output_token_ids
            # its K/V: every known token (the last one's came with the catch-up), then the
            # proposals but the last
            self._written[seq] = _Written(seq.num_tokens, view.output_token_ids[:-1])
        return len(steps), sum(steps[:-self.num_tokens])

    def _view(self, seq: Sequence) -> Sequence:
        """The draft's side of `seq`: its known tokens as the prompt, its computed tokens those
        whose draft K/V are in the pages, the target's group 0 page table (a full group's); its
        outputs will be the proposals."""
        return Sequence(seq_id=seq.seq_id, request_id=seq.request_id, prompt_token_ids=seq.token_ids,
                        sampling=GREEDY, page_table=seq.page_table, num_computed_tokens=self._valid(seq),
                        status=SequenceStatus.RUNNING)

    def _valid(self, seq: Sequence) -> int:
        """Leading tokens of `seq` whose draft K/V are in its pages."""
        written = self._written.get(seq)
        if written is None:
            return 0
        valid, tokens = written.valid, seq.token_ids
        for token in written.tail:
            if valid >= len(tokens) or tokens[valid] != token:
                break
            valid += 1
        return min(valid, seq.num_computed_tokens)

    def _rows(self, views: list[Sequence]) -> list[ScheduledSeq]:
        """The next draft step's rows: each view's next tokens not yet in the draft's pages,
        through its last one (which samples a proposal): a catch-up chunk as the engine's budget
        allows (prefill_chunk_size, max_num_batched_tokens, max_prefill_seqs prefill rows a step;
        other rows take one token, riding as decode rows), else the last proposal."""
        cfg = self.runner.ecfg
        rows, budget, prefill_rows = [], cfg.max_num_batched_tokens, 0
        for v in views:
            left = v.num_tokens - v.num_computed_tokens
            n = min(left, cfg.prefill_chunk_size, budget)
            if n > 1 and prefill_rows == cfg.max_prefill_seqs:
                n = 1
            if n == 0:
                break
            prefill_rows += n > 1
            budget -= n
            rows.append(ScheduledSeq(v, n, int(n == left), v.num_computed_tokens))
        return rows

    def _step(self, rows: list[ScheduledSeq]) -> None:
        """One draft step: its rows' tokens into the draft's pages, greedy tokens sampled."""
        out = SchedulerOutput(rows, [], [])
        results = self.runner.collect(self.runner.launch(out, {s.seq.seq_id: 0 for s in rows}))
        for s in rows:
            s.seq.num_computed_tokens += s.num_query_tokens
            if s.num_sampled:
                s.seq.output_token_ids.append(results[s.seq.seq_id][0].token)
