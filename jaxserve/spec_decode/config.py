"""The speculative-decoding settings of an engine (EngineConfig.speculative), checked when built."""
from __future__ import annotations

import dataclasses

SPECULATIVE_METHODS = ("ngram", "draft")


@dataclasses.dataclass
class SpeculativeConfig:
    """Speculative decoding (jaxserve/spec_decode/): `num_tokens` proposals per running sequence
    and step, verified by the model in the same step. method "ngram": prompt lookup, the
    continuation of the latest earlier occurrence of the last n tokens (n from ngram_max down
    to ngram_min). method "draft": the greedy continuation of a smaller model sharing the
    target's tokenizer, `model` (an HF directory; None: the embedded model's draft, for the
    embedded model only). A step speculates only while it pays (jaxserve/spec_decode/throttle.py):
    `disable_by_batch_size` None: while the roofline cost model predicts more tokens per second
    with it; a number: while at most that many sequences run (as vLLM's key)."""
    method: str = "ngram"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"engine config: speculative method {self.method!r} is not available "
                             f"(supported: {', '.join(SPECULATIVE_METHODS)})")
        if not 1 <= self.num_tokens <= 15:
            raise ValueError(f"engine config: speculative num_tokens must be in [1, 15], got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"engine config: speculative needs 1 <= ngram_min <= ngram_max, got "
                             f"{self.ngram_min} and {self.ngram_max}")
        if self.model is not None and self.method != "draft":
            raise ValueError(f"engine config: speculative model is for method draft, not {self.method!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"engine config: speculative disable_by_batch_size must be at least 1 or null, "
                             f"got {self.disable_by_batch_size}")
