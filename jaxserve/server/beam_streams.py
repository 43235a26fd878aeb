"""The server's beam search: vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions,
with `n` beams. jaxserve/beam_search.py's rounds run as EngineHost requests; each prompt gets a
stream, as EngineHost.follow takes them, whose one output holds the prompt's n best beams as its
choices, best first (the first stream's turn runs the search for all the request's prompts)."""
from __future__ import annotations

import itertools
import time

from jaxserve import beam_search
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.runner import SampleResult
from jaxserve.sampling_params import SamplingParams


class BeamSearchRequest:
    def __init__(self, host, prompts: list[list[int]], params: SamplingParams,
                 beam: beam_search.BeamSearchParams, request_id: str):
        self.host, self.prompts, self.params, self.beam, self.request_id = host, prompts, params, beam, request_id
        self.arrival_time = time.monotonic()
        self.first_token_time = self.finish_time = None
        self.results: list[list[beam_search.BeamSearchSequence]] | None = None
        self.streams = [_PromptStream(self, i, f"{request_id}-{i}") for i in range(len(prompts))]

    def run(self, alive, deadline) -> bool:
        """Search for every prompt, once; False if the client left meanwhile."""
        if self.results is not None:
            return True
        engine = self.host.require_engine().engine
        params = beam_search.round_params(self.params, beam_search.num_candidates(self.beam, engine.eos_token_ids))
        rounds = itertools.count()

        def next_tokens(batch: list[list[int]]) -> list[list[tuple[int, float]]]:
            streams = self.host.submit(batch, params, f"{self.request_id}-round{next(rounds)}")
            tops = {}
            try:
                for i, stream in enumerate(streams):
                    for out in stream.outputs(alive, deadline):
                        tops.update((i, c.logprobs[0].top) for c in out.outputs if c.logprobs)
                    if i not in tops:
                        raise _ClientGone()
            finally:
                for i, stream in enumerate(streams):
                    if i not in tops:
                        stream.abort()
            self.first_token_time = self.first_token_time or time.monotonic()
            return [tops[i] for i in range(len(batch))]

        try:
            self.results = beam_search.search(self.prompts, self.beam, engine.eos_token_ids, engine.max_model_len,
                                              next_tokens)
        except _ClientGone:
            return False
        self.finish_time = time.monotonic()
        return True

    def output(self, index: int, request_id: str) -> RequestOutput:
        """Prompt `index`'s beams as choices: the generated tokens (an eos kept in token_ids, not in
        the text, as vLLM), with the top `logprobs` of the candidates each was chosen from."""
        decode = self.host.require_engine().engine.tokenizer.decode
        prompt, top_n = self.prompts[index], self.params.logprobs
        choices = []
        for j, beam in enumerate(self.results[index]):
            tokens = beam.tokens[len(prompt):]
            text = decode(tokens[:-1] if beam.finish_reason == "stop" else tokens,
                          skip_special_tokens=self.params.skip_special_tokens)
            logprobs = None if top_n is None else [SampleResult(t, top[t], list(top.items())[:top_n])
                                                   for t, top in zip(tokens, beam.logprobs)]
            choices.append(CompletionOutput(j, text, tokens, logprobs, beam.finish_reason))
        return RequestOutput(request_id, prompt, choices, finished=True,
                             num_generated_tokens=sum(len(c.token_ids) for c in choices),
                             arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                             finish_time=self.finish_time)


class _ClientGone(Exception):
    """A round's request stopped early because its client left."""


class _PromptStream:
    def __init__(self, search: BeamSearchRequest, index: int, request_id: str):
        self.search, self.index, self.request_id = search, index, request_id

    def outputs(self, alive=None, deadline: float | None = None):
        if self.search.run(alive, deadline):
            yield self.search.output(self.index, self.request_id)

    def abort(self) -> None:
        """Nothing to do: each round aborts its own requests when it stops early."""
