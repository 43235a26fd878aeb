"""Beam search (vLLM's `LLM.beam_search` and the server's `use_beam_search`) with transformers'
rules, those of `generate(num_beams=k, early_stopping="never")`, as a host loop over one-token
requests (as vLLM runs it).

Each round extends the live beams of every prompt by one token. Every beam goes to the engine as
a prompt with max_tokens 1, asking for its K most likely next tokens (raw logprobs), where
K = (number of eos tokens + 1) * beam_width, at most MAX_LOGPROBS: enough for beam_width of them
not to be eos. The prefix cache holds the pages earlier rounds computed, so a round computes
about one new token per beam. Per prompt, all beams' candidates are ranked by cumulative
logprob and the first K kept:
- those among the first beam_width that end in eos are finished, scored
  cum_logprob / generated_len ** length_penalty (the eos counted);
- the best beam_width that do not are the next round's beams.
In the last round (max_tokens, or the context's end) the first beam_width candidates all finish.
A prompt keeps its beam_width best finished beams, best first, and stops early once no live beam
can beat the worst of them: logprobs only lower a beam's sum, so its best possible score is its
sum over the longest possible length when the penalty is positive, over its next length if not.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.sampling_params import MAX_LOGPROBS, InvalidRequest, SamplingParams

# The K most likely next tokens (token id, raw logprob) of each token sequence, most likely first.
NextTokens = Callable[[list[list[int]]], list[list[tuple[int, float]]]]


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's: beam_width beams per prompt (at most MAX_LOGPROBS // 2), up to max_tokens each
    (None: to the end of the context)."""
    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise InvalidRequest(f"beam_width must be between 1 and {MAX_LOGPROBS // 2}", param="beam_width")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam, as vLLM's: `tokens` the prompt's and the generated ones; per generated token, the
    candidates it was chosen from ({token id: logprob}, most likely first); `text` set when returned."""
    tokens: list[int]
    logprobs: list[dict[int, float]]
    cum_logprob: float = 0.0
    score: float = 0.0             # cum_logprob / generated_len ** length_penalty, once finished
    finish_reason: str | None = None   # "stop" (eos) or "length"
    text: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # the best first


def round_params(template: SamplingParams, num_candidates: int) -> SamplingParams:
    """A round's request for one beam: its next token's candidates, on `template`'s adapter and
    prefix-cache salt."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=num_candidates,
                          lora_name=template.lora_name, cache_salt=template.cache_salt)


def num_candidates(params: BeamSearchParams, eos_token_ids) -> int:
    return min(MAX_LOGPROBS, (0 if params.ignore_eos else len(eos_token_ids)) * params.beam_width + params.beam_width)


def search(prompts: list[list[int]], params: BeamSearchParams, eos_token_ids, max_model_len: int,
           next_tokens: NextTokens) -> list[list[BeamSearchSequence]]:
    """Each prompt's best finished beams, best first (module docstring)."""
    eos = frozenset(() if params.ignore_eos else eos_token_ids)
    k, n = params.beam_width, num_candidates(params, eos_token_ids)
    lp = params.length_penalty
    live = [[BeamSearchSequence(list(p), [])] for p in prompts]
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    limits = [min(params.max_tokens or max_model_len, max_model_len - len(p)) for p in prompts]
    if bad := [i for i, limit in enumerate(limits) if limit < 1]:
        raise InvalidRequest(f"prompt {bad[0]} leaves no room for a token in the context of {max_model_len}",
                             param="prompt")
    for step in range(1, max(limits, default=0) + 1):
        running = [i for i, beams in enumerate(live) if beams]
        if not running:
            break
        candidates = iter(next_tokens([b.tokens for i in running for b in live[i]]))
        for i in running:
            ranked = sorted(((b.cum_logprob + logprob, b, token, top) for b in live[i]
                             for top in [dict(next(candidates))] for token, logprob in top.items()),
                            key=lambda c: -c[0])[:n]
            last = step == limits[i]
            live[i] = []
            for rank, (cum, parent, token, top) in enumerate(ranked):
                beam = BeamSearchSequence(parent.tokens + [token], parent.logprobs + [top], cum)
                if rank < k and (last or token in eos):
                    beam.finish_reason = "stop" if token in eos else "length"
                    beam.score = cum / step ** lp
                    finished[i].append(beam)
                elif not last and token not in eos and len(live[i]) < k:
                    live[i].append(beam)
            finished[i] = sorted(finished[i], key=lambda b: -b.score)[:k]
            if len(finished[i]) == k and live[i]:
                best = max(b.cum_logprob for b in live[i])
                if max(best / (step + 1) ** lp, best / limits[i] ** lp) <= finished[i][-1].score:
                    live[i] = []
    return finished
