"""Structured output in the overlapped loop: a step with constrained (or penalised) rows launches
its model before the previous step is collected, and its sampler (the grammars' masks built on
the host meanwhile) after. Checked against the synchronous loop (`engine.overlap = False`) of the
same engine: the same outputs, token for token, with constrained, penalised, prompt-logprobs and
free rows mixed in one batch."""
import numpy as np
import pytest

from jaxserve.compilations import CompileCounter
from jaxserve.sampling_params import SamplingParams as P
from jaxserve.structured import StructuredOutput
from tests.structured_cases import CHOICES, REGEX, schemas, warm_llm


@pytest.fixture(scope="module")
def llm():
    return warm_llm()


def requests() -> tuple[list[str], list[P]]:
    """17 sequences for 16 rows: constrained (greedy and seeded, n > 1, a stop string inside the
    grammar: found a step late), penalised (one with a stop string: its next step's deferred
    sampler reads the history of a sequence that stopped), prompt logprobs, and free rows."""
    json_cases = [StructuredOutput.json_schema(s) for s in schemas()[::6]]
    params = [P(max_tokens=64, temperature=0.0 if i % 2 else 0.9, seed=i, n=2 if i == 2 else 1, logprobs=2 if i == 1 else None,
                structured_output=c) for i, c in enumerate(json_cases)]
    params += [P(max_tokens=24, temperature=0.8, seed=1, n=2, structured_output=StructuredOutput("regex", REGEX)),
               P(max_tokens=8, temperature=1.0, seed=2, n=2, structured_output=StructuredOutput("choice", CHOICES)),
               P(max_tokens=24, temperature=0.0, stop=[";"], prompt_logprobs=2,
                 structured_output=StructuredOutput("regex", r"[a-z]{1,5};[0-9]{1,3}")),
               P(max_tokens=30, temperature=0.0, ignore_eos=True),
               P(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True, logprobs=3),
               P(max_tokens=30, temperature=0.7, seed=4, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
               P(max_tokens=12, temperature=0.0, prompt_logprobs=1, stop=["e"], repetition_penalty=1.2)]
    return [f"Example {i}:" for i in range(len(params))], params


class LaunchOrder:
    """Wraps the engine's runner (instance attributes) to count the model launches of steps with a
    constrained sampling row that came before the previous step was collected, and the samplers
    launched on their own."""

    def __init__(self, runner):
        self.runner, self.uncollected, self.overlapped, self.samplers = runner, 0, 0, 0
        self.launch, self.collect, self.sample = runner.launch, runner.collect, runner.sample
        runner.launch, runner.collect, runner.sample = self._launch, self._collect, self._sample

    def _launch(self, out, *args):
        constrained = any(s.seq.grammar is not None for s in out.scheduled if s.num_sampled)
        self.overlapped += constrained and self.uncollected > 0
        self.uncollected += 1
        return self.launch(out, *args)

    def _collect(self, launched):
        self.uncollected -= 1
        return self.collect(launched)

    def _sample(self, launched):
        self.samplers += 1
        return self.sample(launched)

    def detach(self) -> None:
        self.runner.launch, self.runner.collect, self.runner.sample = self.launch, self.collect, self.sample


def test_overlapped_loop_gives_the_synchronous_outputs(llm):
    engine = llm.llm_engine
    prompts, params = requests()
    results, orders = {}, {}
    before = CompileCounter.count
    try:   # overlapped, also as on a GPU: every sampler deferred (engine.step)
        for mode in ("synchronous", "overlapped", "all deferred"):
            engine.overlap, engine._defer_all_samplers = mode != "synchronous", mode == "all deferred"
            orders[mode] = order = LaunchOrder(engine.runner)
            try:
                outputs = llm.generate(prompts, params, use_tqdm=False)
            finally:
                order.detach()
            results[mode] = outputs
            assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    finally:
        engine.overlap, engine._defer_all_samplers = True, False
    assert CompileCounter.count == before, "a deferred sampler compiled after warm-up"
    for synchronous, overlapped in [pair for mode in ("overlapped", "all deferred")
                                    for pair in zip(results["synchronous"], results[mode])]:
        assert [(c.text, c.token_ids, c.finish_reason) for c in overlapped.outputs] == \
            [(c.text, c.token_ids, c.finish_reason) for c in synchronous.outputs]
        # Logprobs: the same ids and ranks; values to float noise (a step's batch differs by the
        # rows of sequences that stopped a step late, whose results are dropped).
        for got, want in [(overlapped.prompt_logprobs, synchronous.prompt_logprobs)] + [
                (a.logprobs, b.logprobs) for a, b in zip(overlapped.outputs, synchronous.outputs)]:
            assert flatten(got)[0] == flatten(want)[0]
            np.testing.assert_allclose(flatten(got)[1], flatten(want)[1], rtol=0, atol=1e-5)
    finishes = [c.finish_reason for o in results["overlapped"] for c in o.outputs]
    assert finishes.count("stop") >= 9 and "length" in finishes   # grammars completed; free rows ran out
    assert orders["synchronous"].overlapped == orders["synchronous"].samplers == 0
    assert orders["overlapped"].overlapped > 20 and orders["overlapped"].samplers >= orders["overlapped"].overlapped
    assert orders["all deferred"].samplers > orders["overlapped"].samplers


def flatten(logprobs) -> tuple[list, list[float]]:
    """Logprob dicts (or None entries, or None) as ([(position, token id, rank)], [logprob])."""
    keys, values = [], []
    for i, entry in enumerate(logprobs or []):
        for token, lp in (entry or {}).items():
            keys.append((i, token, lp.rank))
            values.append(lp.logprob)
    return keys, values
