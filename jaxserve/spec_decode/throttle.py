"""When a step speculates (issue 16, item 5: under load, speculation costs compute).

Speculating turns a decode row of one token into a verify row of 1 + k tokens, and yields
1 + a tokens a row, a the mean accepted proposals per verify row. While a decode step is
limited by memory bandwidth (every weight and the batch's K/V are read once, however many
tokens), the k extra tokens are close to free; once the batch is large, they cost k + 1 times
the decode's FLOPs, and speculating is slower than not (the static shapes charge all k + 1 for
every row: buckets.py). So before each step, over the B running sequences that would verify
(with their context lengths), the throttle predicts the time of
    plain  = a decode step of B one-token rows,
    verify = a step of B rows of 1 + k tokens (+ with a draft model: k draft steps of B
             one-token rows),
each as its kind's overhead + max(FLOPs / peak FLOP/s, bytes / peak bandwidth) (the roofline:
jaxserve/roofline.py, peaks from the datasheet or measured on this machine once per process),
and the step speculates while verify < (1 + a) x plain: more tokens a second. `a` is a running
mean (exponential, over about the last 64 rows) of the proposals accepted per row a step
speculated for (0 where the row did not verify: n-gram lookup found nothing), from k / 2.

A kind's overhead is what its steps cost beyond their roofline time: packing, dispatch, the
sampler, the results back on the host, the draft's steps' own overheads, whether the step
overlaps the one before. It is learned from the steps themselves (`observe`): the median of its
latest MEDIAN_OVER_STEPS steps' time less their roofline time (a median: a kind's first step
after a prompt pays one-time costs), 0 until one ran. A step's time: the engine times the
interval between two steps' planning (`begins`). That interval waits on the device work of the step
planned two steps before (a step collects its predecessor's results before or after launching
its own), so that is the step it prices (else the first verify step after a prompt's prefill
would be charged the prefill's compute), with that step's planning in place of the latest
one's (`planned`; else a plain step followed by a verify step would be charged the draft
model's k steps, and the plain price so inflated would keep every step speculating), less a
draft's catch-up (prompts' K/V: a prefill's work, no step's). A step let speculate whose rows
got no proposals runs plain-shaped and is not priced. A plain step is priced only where
the next step is plain too: in a run of plain steps each overlaps the next one's planning
(engine.py), as the one before a verify step does not.

Each overhead is learned from steps of its kind only: a verify step priced too low is tried,
measured and dropped within a few steps; one priced too high is not tried again, which errs on
the side of not speculating. So that the plain price cannot go stale while every step
speculates (one measured at a larger batch would keep it speculating), after every
REFRESH_PLAIN steps in a row that would speculate, REFRESH_RUN steps run plain (all but the
last priced).

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

import collections
import dataclasses
import functools
import time

import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.roofline import CostModel, device_peaks

MEAN_OVER_ROWS = 64      # the acceptance's running mean
MEDIAN_OVER_STEPS = 5    # the overheads'
REFRESH_PLAIN, REFRESH_RUN = 32, 3
LAG = 2                  # steps between a step's planning and the interval that waits on its device work

_peaks = functools.cache(device_peaks)   # measured once per process on a device without a datasheet


@dataclasses.dataclass
class _Step:
    """A planned step, as its price needs it."""
    speculates: bool | None   # the rule's decision; None where it did not decide (not priced)
    roofline: float = 0.0     # seconds
    planning: float = 0.0     # seconds planning and launching it, less a draft's catch-up
    held: float = 0.0         # seconds of the interval it was planned in that are not its predecessor's
    candidates: int = 0       # rows that would verify
    verifies: bool = False    # it has verify rows (a speculating step whose rows got no proposals has none)


class Throttle:
    def __init__(self, spec: SpeculativeConfig, target: ModelConfig, draft: ModelConfig | None, itemsize: int):
        self.spec = spec
        self._models = target, draft, itemsize
        self.mean_accepted = spec.num_tokens / 2
        # seconds a plain (False) and a speculating (True) step cost beyond their roofline time
        self.overheads: dict[bool, float | None] = {False: None, True: None}
        self._extras = {kind: collections.deque(maxlen=MEDIAN_OVER_STEPS) for kind in self.overheads}
        self._steps: collections.deque[_Step] = collections.deque(maxlen=LAG)   # the latest, oldest first
        self._speculating = 0   # steps in a row the rule would speculate
        self._began: float | None = None   # when the latest step's planning began, None: idle since

    @functools.cached_property
    def _costs(self) -> tuple[CostModel, CostModel | None]:
        target, draft, itemsize = self._models
        return CostModel(target, itemsize), CostModel(draft, itemsize) if draft is not None else None

    def speculates(self, contexts: list[int], prefills: bool) -> bool:
        """Whether the next step speculates, its verify candidates having computed `contexts`
        tokens, `prefills`: whether it has prompt tokens to compute too."""
        if not contexts or self.spec.disable_by_batch_size is not None or prefills:
            self._steps.append(_Step(None))
            limit = self.spec.disable_by_batch_size
            return bool(contexts) and limit is not None and len(contexts) <= limit
        k, (target, draft) = self.spec.num_tokens, self._costs
        plain = _roofline_seconds(target, contexts, 1)
        verify = _roofline_seconds(target, contexts, 1 + k)
        if draft is not None:
            verify += k * _roofline_seconds(draft, contexts, 1)
        overhead = {kind: seconds or 0.0 for kind, seconds in self.overheads.items()}
        speculate = overhead[True] + verify < (1 + self.mean_accepted) * (overhead[False] + plain)
        self._speculating = self._speculating + 1 if speculate else 0
        speculate = speculate and (self._speculating - 1) % (REFRESH_PLAIN + REFRESH_RUN) < REFRESH_PLAIN
        self._steps.append(_Step(speculate, verify if speculate else plain, candidates=len(contexts)))
        return speculate

    def begins(self) -> None:
        """The engine begins planning a step: the interval since the last one is observed."""
        now = time.perf_counter()
        self.observe(self._began and now - self._began)
        self._began = now

    def idle(self) -> None:
        """The engine waits for requests: the next interval is no step's time."""
        self._began = None

    def planned(self, seconds: float, catching_up: float, verify_rows: int) -> None:
        """Planning and launching the latest step took `seconds`, `catching_up` of them the
        draft's catch-up; it has `verify_rows`. Each row it speculated for that does not verify
        (n-gram lookup found nothing) accepts nothing: it costs a verify row (the static shapes)."""
        step = self._steps[-1]
        step.planning, step.held, step.verifies = seconds - catching_up, seconds, verify_rows > 0
        for _ in range(step.candidates - verify_rows if step.speculates else 0):
            self.accepted(0)

    def observe(self, seconds: float | None) -> None:
        """`seconds` from the last step's planning to this one's: with the planning moved, the
        price of the step planned LAG steps before, if the rule decided it. None: the engine was
        idle since the last step, and the steps before are not priced."""
        if seconds is None:
            self._steps.clear()
        if len(self._steps) < LAG:
            return
        step, latest = self._steps.popleft(), self._steps[-1]
        if step.speculates is None or step.speculates != step.verifies:
            return   # not the rule's, or it ran plain-shaped without proposals
        if not step.speculates and latest.speculates:
            return   # a plain step that the latest, speculating, did not overlap
        seconds += step.planning - latest.held   # its planning, not the latest step's
        self._extras[step.speculates].append(max(0.0, seconds - step.roofline))
        self.overheads[step.speculates] = float(np.median(self._extras[step.speculates]))

    def accepted(self, proposals: int) -> None:
        """A verify row kept this many proposals."""
        self.mean_accepted += (proposals - self.mean_accepted) / MEAN_OVER_ROWS


def _roofline_seconds(cost: CostModel, contexts: list[int], n: int) -> float:
    """A step of one n-token row per context (every token sampled), at the roofline."""
    c = np.asarray(contexts)
    return cost.step(np.stack([np.full_like(c, n), c + n, np.full_like(c, n)], axis=1)).seconds(_peaks())
