"""Speculative decoding with n-gram prompt lookup: verify rows through the runner and sampler,
the accepted run cut by every stop condition, and outputs identical with speculation on and off
(greedy, and seeded sampling: each position draws the randomness it would draw without
speculation). The embedded tiny model repeats itself enough for proposals to be accepted."""
import argparse
import json

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, cli
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig
from jaxserve.spec_decode import ngram

SPEC = {"method": "ngram", "num_tokens": 3, "ngram_min": 1, "ngram_max": 3}
# Small buckets; a pool of 24 pages of 16 tokens for 6 sequences of up to ~190 tokens preempts.
ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_prefill_seqs=2,
              max_model_len=256, num_pages=24, page_size=16, compilation_cache_dir=None)
PROMPTS = ["The for statement is used to", "def square(x):\n    return x * x\n\ndef cube(x):\n",
           "A list is a sequence. A list is", "import os\nimport sys\nimport", "The with statement",
           "Exceptions are raised when"]


def naive_propose(tokens, k, n_min, n_max):
    for n in range(n_max, n_min - 1, -1):
        if len(tokens) <= n:
            continue
        for start in range(len(tokens) - n - 1, -1, -1):   # latest earlier occurrence first
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
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
        EngineConfig(speculative={"method": "draft"})
    with pytest.raises(ValueError, match="ngram_min <= ngram_max"):
        EngineConfig(speculative={"ngram_min": 3, "ngram_max": 2})


@pytest.fixture(scope="module")
def engines():
    """(plain, speculative) LLMs on the embedded model, both warmed up."""
    plain = LLM(**ENGINE, enable_prefix_caching=True)
    spec = LLM(**ENGINE, enable_prefix_caching=True, speculative=SPEC)
    for llm in (plain, spec):
        llm.llm_engine.warmup()
    return plain, spec


def _run(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("case", ["greedy", "max_tokens", "stop", "seeded_n2"])
def test_same_outputs_with_and_without_speculation(engines, case):
    plain, spec = engines
    params = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
        "max_tokens": SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
        "stop": SamplingParams(temperature=0.0, max_tokens=120, stop=["\n\n", "list"]),
        "seeded_n2": SamplingParams(temperature=0.8, top_p=0.9, max_tokens=60, n=2, seed=7, ignore_eos=True),
    }[case]
    stats = spec.llm_engine.stats
    before = dict(stats)
    compiles = CompileCounter.count
    assert _run(spec, params) == _run(plain, params)
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
