"""Speculative decoding with n-gram prompt lookup: verify rows through the runner and sampler,
the accepted run cut by every stop condition, and outputs identical with speculation on and off
(greedy, and seeded sampling: each position draws the randomness it would draw without
speculation), also while the throttle turns speculation off and on (jaxserve/spec_decode/throttle.py,
its rule against its closed form). The embedded tiny model repeats itself enough for proposals
to be accepted."""
import argparse
import collections
import dataclasses
import functools
import json

import numpy as np
import pytest
import transformers

import jaxserve.runner as runner_module
from jaxserve import LLM, SamplingParams, cli
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.packing import pack
from jaxserve.roofline import Peaks
from jaxserve.spec_decode import ngram, throttle
from jaxserve.spec_decode.throttle import Throttle
from tests.server_harness import store_of
from tests.target_distribution import DRAWS, chi_square_p, exact_triples, next_logits, sampled_triples

# Never throttled at max_num_seqs 8 (the throttle's tests lower the bound while they run).
SPEC = {"method": "ngram", "num_tokens": 3, "ngram_min": 1, "ngram_max": 3, "disable_by_batch_size": 8}
# Small buckets; a pool of 24 pages of 16 tokens for 6 sequences of up to ~190 tokens preempts.
# One prefill row a step, and only the largest step shapes (a decode and a prefill shape of each
# decode width, plain and verify: 4 rather than 14): speculation is about the decode rows, and the
# draft's catch-up still runs rows beside its one prefill row. CPU seconds, cold stores, -n 2
# (2026-11-30): this file 279 -> 174 and 185 in two runs; the draft's 208 -> 135, then 209.
# One executable store for both spec-decode files: the second loads the plain engine's executables.
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_prefill_seqs=1,
                max_model_len=256, num_pages=24, page_size=16, step_shapes="largest")
ENGINE = dict(SETTINGS, compilation_cache_dir=store_of(SETTINGS))
PROMPTS = ["The for statement is used to", "def square(x):\n    return x * x\n\ndef cube(x):\n",
           "A list is a sequence. A list is", "import os\nimport sys\nimport", "The with statement",
           "Exceptions are raised when"]


def naive_propose(tokens, k, n_min, n_max):
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):   # latest earlier occurrence first
            if tokens[start:start + n] == tokens[-n:]:
                text = list(tokens)   # copy one token at a time: the copy may read its own output
                for i in range(start + n, start + n + k):
                    text.append(text[i])
                return text[len(tokens):]
    return []


def test_ngram_proposals_match_a_naive_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 30)).tolist()
        k, n_min = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        n_max = n_min + int(rng.integers(0, 3))
        assert ngram.propose(tokens, k, n_min, n_max) == naive_propose(tokens, k, n_min, n_max), tokens


def test_config_is_checked():
    assert EngineConfig(speculative=SPEC).speculative.num_tokens == 3
    args = argparse.ArgumentParser()
    cli._add_model_args(args)
    cfg = cli.engine_config(args.parse_args(["--speculative-config", json.dumps(SPEC)]))
    assert cfg.speculative == EngineConfig(speculative=SPEC).speculative
    with pytest.raises(ValueError, match="not available"):
        EngineConfig(speculative={"method": "eagle"})
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        EngineConfig(speculative={"ngram_min": 3, "ngram_max": 2})
    with pytest.raises(ValueError, match="disable_by_batch_size must be at least 1"):
        EngineConfig(speculative={"disable_by_batch_size": 0})


def warm_llm(speculative=None) -> LLM:
    """An LLM on the embedded model with prefix caching, warmed up; `speculative` as the config key."""
    llm = LLM(**ENGINE, enable_prefix_caching=True, speculative=speculative)
    llm.llm_engine.warmup()
    return llm


@functools.cache
def plain_llm() -> LLM:
    """The reference without speculation, one per process (tests/test_spec_decode_draft.py too)."""
    return warm_llm()


@pytest.fixture(scope="module")
def engines():
    """(plain, speculative) LLMs on the embedded model, both warmed up."""
    return plain_llm(), warm_llm(SPEC)


def _run(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


# Each with and without speculation (the greedy case: 6 x 160 tokens in 24 pages of 16 preempt).
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
    "max_tokens": SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
    "stop": SamplingParams(temperature=0.0, max_tokens=120, stop=["\n\n", "list"]),
    "seeded_n2": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, n=2, seed=7, ignore_eos=True),
}


@functools.cache
def plain_outputs(case: str):
    """CASES[case]'s outputs without speculation, once per process."""
    return _run(plain_llm(), CASES[case])


@pytest.mark.parametrize("case", CASES)
def test_same_outputs_with_and_without_speculation(engines, case):
    _, spec = engines
    params = CASES[case]
    stats = spec.llm_engine.stats
    before = dict(stats)
    compiles = CompileCounter.count
    assert _run(spec, params) == plain_outputs(case)
    assert CompileCounter.count == compiles   # every verify shape was compiled at warm-up
    assert stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]   # proposals were accepted
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"]   # and some rejected
    if case == "greedy":   # 6 x 160 tokens in 24 pages of 16: sequences were preempted
        assert spec.llm_engine.scheduler.num_preemptions > 0


def test_accepted_run_is_fewer_steps(engines):
    _, spec = engines
    stats = spec.llm_engine.stats
    steps, tokens = stats["steps"], stats["generation_tokens"]
    spec.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), use_tqdm=False)
    assert stats["generation_tokens"] - tokens > 1.3 * (stats["steps"] - steps)


def test_a_step_after_a_verify_step_verifies_too(engines, monkeypatch):
    """The step after a verify step decides whether to speculate once that step's accepted runs
    are collected (they are the proposals' context): with a proposal always there and the rule
    saying yes, every step after the prompt's verifies, but the last two (one token left: no room
    to propose; then the step that only collects)."""
    engine = engines[1].llm_engine
    monkeypatch.setattr(ngram, "propose", lambda tokens, k, *_: [tokens[-1]] * k)
    engine.add_request(list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True))
    verifies = []
    while engine.has_unfinished():
        engine.step()
        verifies.append(any(s.num_sampled > 1 for s in engine.last_schedule.scheduled))
    assert not verifies[0] and len(verifies) > 10 and all(verifies[1:-2]), verifies


# ---- the throttle: speculation off while it would not pay ----

def test_roofline_rule_matches_its_closed_form(monkeypatch):
    """Short contexts: the rule speculates up to B* = (1 + a) s F / (2 (k + 1) W) rows (the
    throttle's docstring), within the K/V bytes the closed form leaves out (10% margins); with a
    draft, at one row (both steps memory-bound) while k P_draft / P < a."""
    k, itemsize = 4, 2
    target = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    draft = ModelConfig.from_pretrained(f"{TINY_MODEL_DIR}/draft")
    rule = Throttle(SpeculativeConfig(num_tokens=k), target, None, itemsize)
    monkeypatch.setattr(throttle, "_peaks", lambda: Peaks(81e12, 1e12, "test"))   # F / W = 81
    for a in (1.5, 3.5):
        rule.mean_accepted = a
        bound = (1 + a) * itemsize * 81 / (2 * (k + 1))   # 40.5, then 72.9
        assert rule.speculates([1] * int(0.9 * bound), False) and not rule.speculates([1] * int(1.1 * bound), False)
    with_draft = Throttle(SpeculativeConfig(method="draft", num_tokens=k), target, draft, itemsize)
    ratio = k * draft.num_params / target.num_params   # 0.66
    for a, expected in ((0.9 * ratio, False), (1.1 * ratio, True)):
        with_draft.mean_accepted = a
        assert with_draft.speculates([1], False) == expected
    # Steps of a second each (the overheads): the roofline times vanish next to them. With the
    # draft's k steps a verify step costs more than 1 + a plain ones; without a proposer, the same.
    with_draft.overheads, with_draft.mean_accepted = {False: 1.0, True: 1.0 + k}, k / 2
    rule.overheads, rule.mean_accepted = {False: 1.0, True: 1.0}, 0.1
    assert not with_draft.speculates([1], False) and rule.speculates([1] * 64, False)
    assert not rule.speculates([1] * 64, True)   # a step computing prompt tokens never speculates
    rule.overheads[True] = 2.0   # a verify step costing two plain ones pays from a > 1
    assert not rule.speculates([1], False)
    rule.mean_accepted = 1.2
    assert rule.speculates([1], False)
    fixed = Throttle(SpeculativeConfig(num_tokens=k, disable_by_batch_size=2), target, None, itemsize)
    assert fixed.speculates([9, 9], True) and not fixed.speculates([9, 9, 9], False) and not fixed.speculates([], False)


THROTTLE_BOUND = 3
ARRIVALS = {0: [0, 1], 6: [2, 3], 12: [4, 5]}   # engine step -> PROMPTS arriving
MAX_TOKENS = [24, 70, 40, 60, 30, 50]


def _staggered_params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)


@functools.cache
def _staggered_expected() -> list[list[int]]:
    outs = plain_llm().generate([{"prompt_token_ids": ids} for ids in _prompt_ids()],
                                [_staggered_params(i) for i in range(len(PROMPTS))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _prompt_ids() -> list[list[int]]:
    return [plain_llm().get_tokenizer().encode(p) for p in PROMPTS]


def check_throttled_run(llm, monkeypatch):
    """Requests arrive (ARRIVALS) and finish while disable_by_batch_size = THROTTLE_BOUND turns
    speculation off above it and on again below: greedy outputs equal those without
    speculation, no step above the bound has a verify row, steps below it before and after do,
    every batch without a verify row runs in the plain (decode_q = 1) shapes, and those were
    built at warm-up: nothing compiles."""
    engine, expected = llm.llm_engine, _staggered_expected()
    monkeypatch.setattr(engine.ecfg.speculative, "disable_by_batch_size", THROTTLE_BOUND)
    candidates, speculates = [], engine.throttle.speculates

    def counting(contexts, prefills):
        candidates.append(len(contexts))
        return speculates(contexts, prefills)
    monkeypatch.setattr(engine.throttle, "speculates", counting)
    widths = []   # each packed batch: (whether it has a verify row, the width of its decode rows)

    def packing(out, *args, **kwargs):
        batch = pack(out, *args, **kwargs)
        widths.append((any(s.num_sampled > 1 for s in out.scheduled), batch.decode_q))
        return batch
    monkeypatch.setattr(runner_module, "pack", packing)
    off_steps, compiles = engine.stats["spec_off_steps"], CompileCounter.count
    ids, tokens, trace = {}, collections.defaultdict(list), []   # trace: (verify candidates, verify rows) a step
    while len(trace) <= max(ARRIVALS) or engine.has_unfinished():
        for i in ARRIVALS.get(len(trace), []):
            ids[engine.add_request(_prompt_ids()[i], _staggered_params(i))] = i
        for out in engine.step():
            tokens[ids[out.request_id]] += out.outputs[0].token_ids
        trace.append((candidates[-1], sum(s.num_sampled > 1 for s in engine.last_schedule.scheduled)))
    assert CompileCounter.count == compiles
    assert set(widths) == {(False, 1), (True, 1 + engine.ecfg.speculative.num_tokens)}   # plain ones plain
    assert [tokens[i] for i in range(len(PROMPTS))] == expected
    above = [i for i, (n, _) in enumerate(trace) if n > THROTTLE_BOUND]
    assert above and all(trace[i][1] == 0 for i in above), trace
    assert any(rows for _, rows in trace[:above[0]]) and any(rows for _, rows in trace[above[-1]:]), trace
    assert engine.stats["spec_off_steps"] - off_steps == len(above)


def test_throttle_switches_speculation_off_and_on(engines, monkeypatch):
    check_throttled_run(engines[1], monkeypatch)


def test_throttle_learns_step_overheads_and_refreshes_the_plain_price(monkeypatch):
    """Each kind's overhead: the median of its latest steps' time beyond their roofline time,
    learned from that kind only; each interval prices the step planned LAG steps before it, with
    that step's planning in place of the latest one's (a draft's catch-up: no step's); a plain
    step only where the next one is plain too (it overlaps it, as in a run of plain steps);
    REFRESH_RUN plain steps every REFRESH_PLAIN steps in a row that would speculate."""
    monkeypatch.setattr(throttle, "_peaks", lambda: Peaks(1e30, 1e15, "test"))   # memory-bound, nanoseconds
    rule = Throttle(SpeculativeConfig(num_tokens=4), ModelConfig.from_pretrained(TINY_MODEL_DIR), None, 4)
    rule.mean_accepted = 1.0
    assert throttle.LAG == 2
    assert rule.speculates([5], False)     # nothing measured: verifying looks free
    rule.planned(0.75, 0.5, 1)             # its planning: 0.5 s of it the draft catching up
    assert not rule.speculates([5], True)  # a step with prompt tokens: not the rule's, not priced
    rule.planned(0.125, 0.0, 0)
    rule.observe(3.0)                      # the verify step: 3 s - the latest's 0.125 s + its own 0.25 s
    assert rule.overheads[False] is None and rule.overheads[True] == pytest.approx(3.125)
    assert not rule.speculates([5], False)   # 3.125 s against (1 + 1) x 0 s
    rule.observe(99.0)                     # waited on the prompt's step: no price
    rule.observe(99.0)                     # observed twice for one step: nothing left to price
    assert not rule.speculates([5], False)
    rule.observe(1.0)                      # the plain step planned two steps before
    assert rule.overheads == pytest.approx({False: 1.0, True: 3.125})
    rule.observe(None)                     # idle since: the steps planned before are not priced
    assert not rule.speculates([5], False)
    rule.observe(99.0)
    assert rule.overheads == pytest.approx({False: 1.0, True: 3.125})
    for seconds, median in ((0.0, 0.5), (0.0, 0.0)):   # plain steps got faster: the median follows
        assert not rule.speculates([5], False)
        rule.observe(seconds)
        assert rule.overheads[False] == pytest.approx(median)
    rule.overheads = {False: 2.0, True: 3.0}   # now 3 < (1 + 1) x 2: speculate
    assert rule.speculates([5], False)
    rule.planned(0.0, 0.0, 1)
    rule.observe(99.0)                     # the plain step before a verify step: not priced
    assert rule.overheads == {False: 2.0, True: 3.0}
    assert rule.speculates([5, 6, 7], False)
    rule.planned(0.0, 0.0, 0)              # no row got proposals: it ran plain-shaped
    assert rule.mean_accepted == pytest.approx(1.0 * (1 - 1 / throttle.MEAN_OVER_ROWS) ** 3)   # 3 rows accepted 0
    rule.observe(0.5)                      # prices the verify step planned before it
    assert rule.overheads[True] == pytest.approx(np.median([3.125, 0.5]), rel=1e-6)
    assert rule.speculates([5], False)
    rule.observe(99.0)                     # the step that had no verify rows: not priced
    assert rule.overheads[True] == pytest.approx(np.median([3.125, 0.5]), rel=1e-6)
    rule = Throttle(SpeculativeConfig(num_tokens=4), ModelConfig.from_pretrained(TINY_MODEL_DIR), None, 4)
    rule.overheads, rule.mean_accepted = {False: 2.0, True: 3.0}, 1.0   # speculate, with plain refreshes
    period = throttle.REFRESH_PLAIN + throttle.REFRESH_RUN
    decisions = [rule.speculates([5], False) for _ in range(2 * period)]
    assert [i for i, speculates in enumerate(decisions) if not speculates] == [
        i for i in range(2 * period) if i % period >= throttle.REFRESH_PLAIN]


def test_engine_prices_the_steps_it_runs(engines):
    """The engine times each step for its throttle (the interval to the next step's planning),
    and says when it was idle before one."""
    engine = engines[1].llm_engine
    spec = dataclasses.replace(engine.ecfg.speculative, disable_by_batch_size=None)
    rule = Throttle(spec, engine.model_cfg, None, 4)
    observed = []
    rule.observe = lambda seconds: observed.append(seconds)
    engine.throttle, kept = rule, engine.throttle
    try:
        engines[1].generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                            use_tqdm=False)
    finally:
        engine.throttle = kept
    assert observed[0] is None   # idle before the first step
    assert len(observed) >= 20 and all(0 < s < 5 for s in observed[1:])


# ---- exactness when sampling: the output distribution is the target's own ----

@pytest.fixture(scope="module")
def target():
    return transformers.AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, torch_dtype="float32").eval()


@pytest.mark.parametrize("draft, filters", [("agreeing", dict(top_k=4, top_p=1.0)),
                                            ("agreeing", dict(top_k=6, top_p=0.8)),
                                            ("bad", dict(top_k=4, top_p=1.0))])
def test_sampled_tokens_follow_the_targets_distribution(engines, target, monkeypatch, draft, filters):
    """DRAWS seeds, 3 tokens each, the last two through a verify row: the distribution of
    (t1, t2, t3) equals the target's own by a chi-square test, with a draft that agrees with the
    model (it proposes the target's greedy continuation) and with a deliberately bad one (it
    proposes a token the model gives almost no probability). The n-gram lookup is replaced by
    these drafts: the embedded model seldom repeats its prompt within three tokens. The test has
    power: the same counts reject the distribution at temperature 2."""
    greedy = functools.cache(lambda prefix: [int(np.argmax(next_logits(target, list(prefix))))])
    draft_tokens = {"agreeing": lambda tokens: greedy(tuple(tokens)), "bad": lambda tokens: [0]}[draft]
    monkeypatch.setattr(ngram, "propose", lambda tokens, *_: draft_tokens(tokens))
    _, spec = engines
    prompt = spec.get_tokenizer().encode("The with statement")
    counts, proposed, accepted = sampled_triples(spec, prompt, filters)
    assert proposed >= DRAWS   # every request's second step was a verify row
    assert accepted > 0.2 * proposed if draft == "agreeing" else accepted < 0.01 * proposed
    assert chi_square_p(counts, exact_triples(target, prompt, 1.0, **filters), DRAWS) > 1e-3
    assert chi_square_p(counts, exact_triples(target, prompt, 2.0, **filters), DRAWS) < 1e-6
