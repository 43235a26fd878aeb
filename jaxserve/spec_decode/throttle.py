"""When a step speculates (issue 16, item 5: under load, speculation costs compute).

Speculating turns a decode row of one token into a verify row of 1 + k tokens, and yields
1 + a tokens a row, a the mean accepted proposals per verify row. While a decode step is
limited by memory bandwidth (every weight and the batch's K/V are read once, however many
tokens), the k extra tokens are close to free; once the batch is large, they cost k + 1 times
the decode's FLOPs, and speculating is slower than not (the static shapes charge all k + 1 for
every row: buckets.py). So before each step, over the B running sequences that would verify
(with their context lengths), a step's time is predicted as
    its overhead + max(FLOPs / peak FLOP/s, bytes / peak bandwidth)
(the roofline: jaxserve/roofline.py, peaks from the datasheet or measured on this machine once
per process; the overhead: what a step costs beyond that, packing, dispatch, the sampler,
the results back on the host: measured once, `calibrate`, as a one-row step's time minus its
roofline time, for the target's decode and verify steps and the draft's decode step), for
    plain  = a decode step of B one-token rows,
    verify = a step of B rows of 1 + k tokens (+ with a draft model: k draft steps of B
             one-token rows),
and the step speculates while verify < (1 + a) x plain: more tokens a second. `a` is a running
mean (exponential, over about the last 64 verify rows) that starts at k / 2.

Without overheads and K/V (short contexts), with P weights of s bytes each, that is: speculate
up to B* = (1 + a) s F / (2 (k + 1) W) rows, F / W the peak FLOP/s over the bandwidth (there
the verify step turns compute-bound while the plain one is still memory-bound): on an H100 in
bfloat16 (F / W = 295) with k = 4 and a = 2, B* = 177. Long contexts add K/V reads to both
steps and raise it; a draft model's steps lower it. On a CPU the overheads rule: a tiny draft
model's step costs about what the target's does, so the draft never pays there, and n-gram
lookup (no proposer cost) pays at small batches only.

A step that computes prompt tokens does not speculate: its prompt chunk makes it compute-bound
(the verify rows would cost their full FLOPs) and the verify rows would take the chunk's token
budget; the rule above prices decode-only steps.

`disable_by_batch_size` (the speculative config key, vLLM's name) replaces the rule: speculate
while at most that many sequences would verify.

A step that does not speculate has no verify rows: it runs in the plain (decode_q = 1) shapes
that warm-up also builds (buckets.py), so it costs what it would cost without speculation, and
it may overlap with the step before (engine.py). A draft model's K/V catch up with the
target's tokens when speculation resumes (draft.py, `_valid`).
"""
from __future__ import annotations

import functools
import time

from jaxserve.config import ModelConfig, SpeculativeConfig
from jaxserve.roofline import CostModel, device_peaks
from jaxserve.scheduler import ScheduledSeq, SchedulerOutput
from jaxserve.sequence import Sequence

MEAN_OVER_ROWS = 64

_peaks = functools.cache(device_peaks)   # measured once per process on a device without a datasheet


class Throttle:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, draft: ModelConfig | None, itemsize: int):
        self.spec = spec
        self._models = target, draft, itemsize
        self.mean_accepted = spec.num_tokens / 2
        # (target decode, target verify, draft decode) seconds a step costs beyond its roofline
        # time; None: not measured yet (0)
        self.overheads: tuple[float, float, float] | None = None

    @functools.cached_property
    def _costs(self) -> tuple[CostModel, CostModel | None]:
        target, draft, itemsize = self._models
        return CostModel(target, itemsize), CostModel(draft, itemsize) if draft is not None else None

    def speculates(self, contexts: list[int], prefills: bool) -> bool:
        """Whether the next step speculates, its verify candidates having computed `contexts`
        tokens, `prefills`: whether it has prompt tokens to compute too."""
        if not contexts:
            return False
        if self.spec.disable_by_batch_size is not None:
            return len(contexts) <= self.spec.disable_by_batch_size
        if prefills:
            return False
        k, (target, draft) = self.spec.num_tokens, self._costs
        overhead, verify_overhead, draft_overhead = self.overheads or (0.0, 0.0, 0.0)
        verify = verify_overhead + _roofline_seconds(target, contexts, 1 + k)
        if draft is not None:
            verify += k * (draft_overhead + _roofline_seconds(draft, contexts, 1))
        return verify < (1 + self.mean_accepted) * (overhead + _roofline_seconds(target, contexts, 1))

    def accepted(self, proposals: int) -> None:
        """A verify row kept this many proposals."""
        self.mean_accepted += (proposals - self.mean_accepted) / MEAN_OVER_ROWS

    @property
    def uncalibrated(self) -> bool:
        """The rule is in use and its overheads were not measured yet."""
        return self.overheads is None and self.spec.disable_by_batch_size is None

    def calibrate(self, block_manager, target_runner, draft_runner) -> None:
        """Measure the overheads: one-row steps of each runner (jaxserve/runner.py) whose K/V go
        to pages borrowed from the pool (none free: not now)."""
        k = self.spec.num_tokens
        borrowed = Sequence(request_id="throttle-calibration", prompt_token_ids=[0] * (1 + k))
        if block_manager.reserve(borrowed, 1 + k) is None:
            return
        self.overheads = (0.0, 0.0, 0.0)   # (not measured again if this fails)
        try:
            target, draft = self._costs
            pages = borrowed.page_table
            self.overheads = (_overhead(target_runner, target, pages, 1),
                              _overhead(target_runner, target, pages, 1 + k),
                              _overhead(draft_runner, draft, pages, 1) if draft is not None else 0.0)
        finally:
            block_manager.free(borrowed)


def _roofline_seconds(cost: CostModel, contexts: list[int], n: int) -> float:
    """A step of one n-token row per context (every token sampled), at the roofline."""
    return cost.step([(n, c + n, n) for c in contexts]).seconds(_peaks())


def _overhead(runner, cost: CostModel, pages: list[int], n: int, repeats: int = 3) -> float:
    """The best of `repeats` steps of one n-token row sampling every token (packed, run, sampled,
    back on the host), less its roofline time."""
    seq = Sequence(request_id="throttle-calibration", prompt_token_ids=[0] * n, page_table=pages)
    step = SchedulerOutput([ScheduledSeq(seq, n, n, 0)], [], [])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        runner.collect(runner.launch(step, {seq.seq_id: 0}))
        best = min(best, time.perf_counter() - start)
    return max(0.0, best - _roofline_seconds(cost, [0], n))
