"""One generation stream: a prompt, its sampled tokens, and where its K/V live in the page pool."""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import TYPE_CHECKING

import numpy as np

from jaxserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxserve.lora import Adapter
    from jaxserve.pooling import Pooled
    from jaxserve.structured.grammar import Matcher

_seq_ids = itertools.count()
# An output token sampled by a step that is still running: its value is on the device (the next
# step reads it there, see jaxserve/engine.py), the host learns it when that step is collected.
PENDING = -1


class PageTable(list):
    """A sequence's physical pages: a list, which the BlockManager edits as one, and an int32
    copy of it that a step packs with one numpy copy a row (packing.pack). Packing the lists
    converted every page's Python int each step: 1.6 ms a step at 128 rows of 512 pages (8k
    tokens) on the 2-core dev box, against 0.05 ms from the copies. Any edit drops the copy and
    the next step remakes it: once a page, not once a step (a decode token lands in its row's
    last page without an edit)."""
    __slots__ = ("_array",)

    def __init__(self, pages=()):
        super().__init__(pages)
        self._array = None

    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.array(self, np.int32)
        return self._array


def _edit(name: str):
    def edited(self, *args, **kwargs):
        self._array = None
        return getattr(list, name)(self, *args, **kwargs)
    edited.__name__ = name
    return edited


for _name in ("append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(PageTable, _name, _edit(_name))


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False, kw_only=True)
class Sequence:
    """A request with n choices is n Sequences sharing `request_id` (index 0..n-1)."""
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    index: int = 0
    seed: int = 0                      # the sampler's seed for this choice (set by the engine)
    # Tokens that end it (its stop_token_ids, and eos unless ignore_eos; set by the engine): the
    # sampler bans them until it has min_tokens outputs.
    end_token_ids: tuple[int, ...] = ()
    # With sampling.structured_output: its grammar matcher (jaxserve/structured/grammar.py), which
    # fills the sampler's mask and takes each output token.
    grammar: Matcher | None = None
    # With sampling.allowed_token_ids: the sampler's mask row of those tokens (int32 words, as
    # jaxserve/structured/masks.py packs them), shared by the request's choices.
    allowed_mask: np.ndarray | None = None
    # With sampling.bad_words: their token ids (sampling.py bans each one's last token where the
    # outputs end in the rest), shared by the request's choices.
    bad_words: tuple[tuple[int, ...], ...] = ()
    lora: Adapter | None = None        # the LoRA adapter it runs on (None: the base model; set by the engine)
    lora_slot: int = 0                 # that adapter's slot while it runs (0: none; set by Adapters.assign)
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    # Guesses of the tokens after token_ids (speculative decoding). The next step that schedules
    # the sequence verifies them if all its tokens but the last are computed, and clears them.
    proposed_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0       # tokens whose K/V are in the cache
    num_cached_tokens: int | None = None   # prompt tokens found in the prefix cache when first admitted
    # With sampling.prompt_logprobs: entry k for prompt token k + 1 (filled by the runner, see
    # jaxserve/prompt_logprobs.py).
    prompt_logprobs: list = dataclasses.field(default_factory=list)
    # An embedding request's pooling of its prompt's hidden states (jaxserve/pooling.py; set by the engine).
    pooling: Pooled | None = None
    # Owned by the BlockManager: physical pages (of KV group 0, and of groups 1.. in group_tables:
    # jaxserve/kv_groups.py; none without them), and the chained prefix-cache keys of the
    # sequence's first len(page_hashes) full pages.
    page_table: PageTable = dataclasses.field(default_factory=PageTable)
    group_tables: list[PageTable] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None   # 'stop' | 'length' | 'abort'
    # known_token_array's copy and how much of it is filled
    _known: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32), init=False, repr=False)
    _known_len: int = dataclasses.field(default=0, init=False, repr=False)

    @property
    def page_tables(self) -> list[PageTable]:
        """Its page table of every KV group, group 0's first."""
        return [self.page_table, *self.group_tables]

    @property
    def lora_id(self) -> int | None:
        """Its adapter's id (the prefix cache's key), None on the base model."""
        return None if self.lora is None else self.lora.id

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without building token_ids."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:end] + self.output_token_ids[:max(end - n, 0)]

    @property
    def num_known_outputs(self) -> int:
        """Outputs whose values the host has: all but the PENDING ones, which are always the last
        (one per step in flight), so this looks only at those."""
        i = len(self.output_token_ids)
        while i and self.output_token_ids[i - 1] == PENDING:
            i -= 1
        return i

    def known_token_array(self) -> np.ndarray:
        """The prompt and the known outputs as int32 (a penalised row's sampler history), as
        PageTable.array: a copy kept between steps and grown by the outputs learned since (known
        outputs only grow, but for a cut after a stop). Converting the lists each step cost 1.2 ms a step at 64 rows of 1,000
        tokens on the 2-core dev box (benchmarks/host_time.py --penalties)."""
        n = self.num_prompt_tokens + self.num_known_outputs
        have = min(self._known_len, n)
        if n > len(self._known):
            self._known = np.concatenate([self._known[:have], np.empty(max(n, 2 * len(self._known)) - have, np.int32)])
        self._known[have:n] = self.token_range(have, n)
        self._known_len = n
        return self._known[:n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def needs_prompt_hidden_states(self) -> bool:
        """Whether it reads the hidden states of prompt positions before its last (prompt
        logprobs, MEAN or CLS pooling): cached prefix pages have none."""
        return self.sampling.prompt_logprobs is not None or (self.pooling is not None and self.pooling.type != "LAST")

    @property
    def priority(self) -> int:
        return self.sampling.priority

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
