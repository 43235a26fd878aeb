"""The bucket policy: the static shapes a step is padded to, and the list warm-up compiles.

Static shapes come in two families:
  * decode-only steps:  decode rows S
  * steps with prefill: (tokens T, prefill rows S_p, bound on a row's new tokens: 32 or the
    chunk size), the decode rows at their maximum. The XLA attention path pads each prefill row
    to that bound, so its steps come in prefill-row and bound buckets; the Pallas kernels take
    ragged rows (their work follows the tokens), so theirs have all max_prefill_seqs rows and
    the chunk size: one shape per token bucket, a third or less of the compilations.
Decode rows bring one token each, or with speculative decoding up to 1 + k (a verify row: the
last token and k proposals; a plain decode among them uses one of its slots), and every token
of a decode row is sampled: the logits come for decode rows x tokens per decode row. With
speculative decoding every shape comes in both widths, decode_q = 1 + k for a step with verify
rows and decode_q = 1 for one without (a step the throttle keeps plain,
jaxserve/spec_decode/throttle.py, or no proposal found): such a step costs what it would cost
without speculation.
The runner packs each step into one of them; warm-up and `jaxserve check` compile all of them.
While warm-up still builds the smaller ones in the background, a step pads up into the smallest
shape already built that holds it (`cover`; see jaxserve/warmup.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxserve.config import EngineConfig

# Steps whose prefill chunks are all this short pad each to it rather than to the chunk size:
# the XLA path attends over [prefill rows, max_q] queries, and chat-length prompts are short.
SHORT_PREFILL_Q = 32


def powers_of_two(lo: int, hi: int, halfway_from: int | None = None) -> list[int]:
    """Powers of two from lo up to hi (hi itself last). From `halfway_from` on, also 1.5x each
    power of two: padding stays under a third where a step's cost follows its size."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        if halfway_from is not None and b >= halfway_from and b * 3 // 2 < hi:
            out.append(b * 3 // 2)
        b *= 2
    return out + [hi]


def bucket(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class StepShape(NamedTuple):
    tokens: int
    decode_rows: int
    prefill_rows: int
    max_q: int
    decode_q: int = 1   # tokens per decode row (1 + proposals with speculative decoding)

    @property
    def name(self) -> str:
        verify = f"v{self.decode_q}" if self.decode_q > 1 else ""
        if not self.prefill_rows:
            return f"decode-{self.decode_rows}{verify}"
        return f"prefill-{self.tokens}x{self.prefill_rows}q{self.max_q}{verify}"

    @property
    def plain_decode(self) -> bool:
        """Decode rows of one token each: the shapes a multi-step decode runs in (step.py)."""
        return not self.prefill_rows and self.decode_q == 1

    @property
    def logit_rows(self) -> int:
        """Positions the step samples from: every token of every decode row."""
        return self.decode_rows * self.decode_q

    def empty_batch(self, max_pages_per_seq: int, padding_slot: int, groups: int = 1) -> tuple[np.ndarray, ...]:
        """The step's arrays for a batch with nothing in it (nothing written, nothing attended):
        tokens, positions, slot_mapping, page_table, seq_lens, query_start_loc, logits_index;
        groups > 1: slot_mapping and page_table per KV group (jaxserve/kv_groups.py)."""
        t, rows = self.tokens, self.prefill_rows + self.decode_rows
        return (np.zeros(t, np.int32), np.zeros(t, np.int32),
                drop_lone_group(np.full((groups, t), padding_slot, np.int32)),
                drop_lone_group(np.zeros((groups, rows, max_pages_per_seq), np.int32)), np.zeros(rows, np.int32),
                np.zeros(rows + 1, np.int32), np.zeros(self.logit_rows, np.int32))


def drop_lone_group(array: np.ndarray) -> np.ndarray:
    """A page table or slot mapping built with a leading KV-group axis, as a step takes it: a
    cache without groups (one) takes it without that axis (jaxserve/kv_groups.py)."""
    return array[0] if len(array) == 1 else array


class PlatformBuckets(NamedTuple):
    """Where a platform's buckets start. A CPU pays for every row and token, so it gets small
    buckets and, from 32 decode rows, halfway sizes (48, 96, ...: padding under a third). A TPU or
    GPU step reads every weight whatever its rows and tokens, and only the real rows' KV: 8 rows
    cost what 1 does (a TPU's sublanes; a GPU's GEMMs and kernels), 64 what 48 do, and below ~240
    tokens (a Linear's FLOPs per weight byte against the chip's FLOPs per HBM byte: ~300 on an
    H100, ~240 on a v5e) 128 tokens what 16 do. There smaller or halfway buckets would only add
    steps and samplers to compile."""
    min_decode_rows: int
    decode_halfway_from: int | None
    min_step_tokens: int   # of a step with prefill

    @classmethod
    def of(cls, platform: str) -> "PlatformBuckets":
        return cls(1, 32, 16) if platform == "cpu" else cls(8, None, 128)


class Buckets:
    def __init__(self, ecfg: EngineConfig, seq_size: int = 1, platform: str = "cpu", backend: str = "xla"):
        self.ecfg = ecfg
        self.ragged = backend != "xla"   # Pallas attention: prefill rows are not padded to max_q
        rules = PlatformBuckets.of(platform)
        self.decode = powers_of_two(min(rules.min_decode_rows, ecfg.max_num_seqs), ecfg.max_num_seqs,
                                    halfway_from=rules.decode_halfway_from)
        self.tokens = powers_of_two(min(rules.min_step_tokens, ecfg.max_num_batched_tokens),
                                    ecfg.max_num_batched_tokens, halfway_from=128)
        self.prefill_rows = [ecfg.max_prefill_seqs] if self.ragged else powers_of_two(1, ecfg.max_prefill_seqs)
        self.decode_q = 1 + (ecfg.speculative.num_tokens if ecfg.speculative else 0)   # the widest
        self.decode_qs = sorted({1, self.decode_q})
        if any(t % seq_size for t in self.tokens):
            raise ValueError(f"token buckets {self.tokens} must be multiples of the mesh's seq size "
                             f"{seq_size} (set max_num_batched_tokens to one)")

    @property
    def max_logit_rows(self) -> int:
        return self.decode[-1] * self.decode_q

    def step_decode_q(self, has_verify_rows: bool) -> int:
        """The width of a step's decode rows."""
        return self.decode_q if has_verify_rows else self.decode_qs[0]

    def max_q_options(self, t: int, decode_q: int) -> list[int]:
        """The static bounds on one sequence's new tokens in a prefill step of t tokens."""
        chunk = min(t, self.ecfg.prefill_chunk_size)
        if self.ragged:
            return [max(chunk, decode_q)]
        return sorted({max(min(t, SHORT_PREFILL_Q), decode_q), chunk})

    def warmup_shapes(self, prefills_sequence_parallel: bool) -> list[StepShape]:
        """Every shape the batched step runs in (without prefill rows when prefills run
        sequence-parallel on their own); with step_shapes "largest", only `largest` of them."""
        shapes = [StepShape(sd * dq, sd, 0, dq, dq) for dq in self.decode_qs for sd in self.decode]
        if not prefills_sequence_parallel:
            shapes += [StepShape(t, self.decode[-1], sp, max_q, dq) for dq in self.decode_qs for t in self.tokens
                       for sp in self.prefill_rows for max_q in self.max_q_options(t, dq)]
        return largest(shapes) if self.ecfg.step_shapes == "largest" else shapes


def largest(shapes: list[StepShape]) -> list[StepShape]:
    """The largest decode shape and the largest shape with prefill rows among `shapes`, of each
    decode row width (every shape of warmup_shapes fits one of them: `cover`; a step without
    verify rows keeps its plain width)."""
    families = {}
    for s in shapes:
        families.setdefault((bool(s.prefill_rows), s.decode_q), []).append(s)
    return [max(f, key=lambda s: (s.tokens, s.prefill_rows, s.max_q, s.decode_rows)) for f in families.values()]


def cover(shape: StepShape, ready: frozenset[StepShape] | None) -> StepShape:
    """The smallest shape of `ready` that holds a batch packed for `shape` (as many or more
    tokens, rows, max_q and decode row width, of the same family); `shape` itself when `ready`
    is None (no limit)."""
    if ready is None or shape in ready:
        return shape
    fits = [s for s in ready if bool(s.prefill_rows) == bool(shape.prefill_rows) and s.decode_q >= shape.decode_q
            and s.tokens >= shape.tokens and s.decode_rows >= shape.decode_rows
            and s.prefill_rows >= shape.prefill_rows and s.max_q >= shape.max_q]
    if not fits:
        raise ValueError(f"no step shape built yet holds {shape.name}")
    return min(fits, key=lambda s: (s.tokens, s.decode_rows, s.prefill_rows, s.max_q, s.decode_q))
