"""A batch's computations as host messages: each op (the batched step, a sequence-parallel
prefill, the prompt logprobs or pooling sums of the computation just before, a deferred sampler,
a multi-step decode) is a kind, static args and host arrays, which multi-host broadcasts and every
process replays (ModelRunner.replay)."""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import numpy as np

from jaxserve.sampling import SamplingMetadata

STEP, SEQUENCE_PARALLEL, PROMPT_LOGPROBS, SAMPLE, MULTI_STEP, POOL = 0, 1, 2, 3, 4, 5


class Launched(NamedTuple):
    """A batch on its way (ModelRunner.launch): its computations and their device outputs."""
    ops: list
    sampled: list                 # per op: its SampleOutput, prompt logprobs, pooling sums or None, on device
    sampler_arrays: Callable[[], SamplingMetadata] | None = None   # the batched step's sampler waits for `sample`


class Op(NamedTuple):
    """One computation of a step (the batched step, a sequence-parallel prefill, the prompt
    logprobs or the pooling sums of the computation just before, the batched step's deferred
    sampler, or a multi-step decode) and its sampler."""
    static: list            # kind, then the static args (step: num_prefill_rows, max_q, decode_q, sample
                            # later; multi-step: steps, filters)
    arrays: tuple           # the computation's host arrays (the step's: then where PENDING tokens are read)
    seqs: list              # the sequences it samples for, in row order
    md: SamplingMetadata | None
    counts: list | None = None   # prompt logprobs: each sequence's scored rows (prompt_logprobs.pack); not sent

    def message(self) -> list[np.ndarray]:
        """As host arrays (what multi-host broadcasts): a header (array counts, kind, static
        args), the arrays, the sampler's arrays."""
        md = [] if self.md is None else [np.asarray(getattr(self.md, f.name)) for f in dataclasses.fields(self.md)]
        return [np.array([len(self.arrays), len(md), *self.static], np.int32), *self.arrays, *md]


def hidden_state_ops(plp, pooled) -> list[Op]:
    """The ops that read the hidden states of the computation just before: its prompt logprobs
    (prompt_logprobs.pack's (seqs, counts, arrays)) and pooling sums (pooling.pack's (seqs,
    arrays)); None: no row asks."""
    return (([] if plp is None else [Op([PROMPT_LOGPROBS], plp[2], plp[0], None, plp[1])])
            + ([] if pooled is None else [Op([POOL], pooled[1], pooled[0], None)]))
