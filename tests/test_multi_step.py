"""Multi-step decoding (EngineConfig.decode_steps): one program runs k decode steps, each step's
sampled tokens the next one's inputs. Checked against the same engine settings with one step a
program: the same tokens, logprobs and texts, with greedy and seeded rows, logprobs, stop strings,
n > 1, penalised rows, a logit bias, min_tokens (its ban ends a row's run), a prompt arriving
while others decode and a constrained row (both run one step at a time), a pool too small for
every row's k tokens ahead (preemption), and max_model_len; no compilation after warm-up; every
page back in the pool."""
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.compilations import CompileCounter
from jaxserve.sampling_params import SamplingParams as P

# One prefill row of up to 32 tokens, and only the largest decode and prefill shapes (step_shapes):
# multi-step decoding is about decode-only steps.
ENGINE = dict(model=None, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_seqs=1,
              prefill_chunk_size=32, compilation_cache_dir=None, step_shapes="largest")
STEPS = 4


def params() -> list[P]:
    return [P(max_tokens=40, temperature=0.0, ignore_eos=True),
            P(max_tokens=33, temperature=0.9, seed=7, logprobs=2, ignore_eos=True),
            P(max_tokens=25, temperature=0.0, stop=["e"]),
            P(max_tokens=30, temperature=1.0, seed=3, n=2),
            P(max_tokens=6, temperature=0.0, min_tokens=5, ignore_eos=True),
            P(max_tokens=12, temperature=0.0, prompt_logprobs=2, ignore_eos=True)]


def penalised() -> list[P]:
    """Rows that sample with the penalties-and-bias variant: penalties, a bias, min_tokens' ban."""
    return [P(max_tokens=14, temperature=0.7, seed=4, ignore_eos=True, repetition_penalty=1.3),
            P(max_tokens=22, temperature=0.0, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7),
            P(max_tokens=17, temperature=0.9, seed=8, logit_bias={40: 4.0, 41: 3.0, 42: -100.0}, logprobs=1,
              ignore_eos=True)]


def outputs(llm, prompts, sampling) -> list:
    """Each choice's tokens, text, finish reason and top logprob ids, their values apart (`same`);
    then the request's count of prompt logprobs."""
    return [[(list(c.token_ids), c.text, c.finish_reason, [sorted(top) for top in c.logprobs or []],
              [sorted(p.logprob for p in top.values()) for top in c.logprobs or []]) for c in o.outputs]
            + [len(o.prompt_logprobs or [])] for o in llm.generate(prompts, sampling, use_tqdm=False)]


def same(a: list, b: list) -> bool:
    """Equal outputs, logprob values to 1e-5 (the programs differ, so may their float rounding)."""
    def close(x, y):
        return len(x) == len(y) and all(np.allclose(p, q, atol=1e-5) for p, q in zip(x, y))
    return (len(a) == len(b) and all(p[-1] == q[-1] and len(p) == len(q) and all(
        c[:4] == d[:4] and close(c[4], d[4]) for c, d in zip(p[:-1], q[:-1])) for p, q in zip(a, b)))


class StepCount:
    """Counts the engine's launches by their decode_steps."""

    def __init__(self, engine):
        self.counts, launch = {}, engine._launch

        def counted(out):
            self.counts[out.decode_steps] = self.counts.get(out.decode_steps, 0) + 1
            return launch(out)
        engine._launch = counted


@pytest.fixture(scope="module")
def engines():
    single, multi = LLM(**ENGINE), LLM(**ENGINE, decode_steps=STEPS)
    multi.llm_engine.warmup()   # the reference compiles what it runs as it runs
    return single, multi


def test_multi_step_gives_the_single_step_outputs(engines):
    single, multi = engines
    counts = StepCount(multi.llm_engine).counts
    sampling = params()
    prompts = [f"Example {i}:" for i in range(len(sampling))]
    before = CompileCounter.count
    got = outputs(multi, prompts, sampling)
    assert CompileCounter.count == before, "multi-step decoding compiled after warm-up"
    assert same(got, outputs(single, prompts, sampling))
    assert counts[STEPS] >= 5 and sum(counts.values()) < 40   # 40 tokens from far fewer programs
    assert multi.llm_engine.stats["multi_step_decodes"] >= counts[STEPS]   # /metrics counts them
    bm = multi.llm_engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_the_samplers_without_conditionals_of_a_gpu(engines, monkeypatch):
    """As on a GPU (step.multi_step_variants): the multi-step decodes' samplers hold no conditional,
    plain ones without top-k/top-p and with, penalised ones with; the same outputs."""
    from jaxserve import runner, step, warmup
    for module in (runner, warmup):
        monkeypatch.setattr(module, "multi_step_variants", lambda platform: step.multi_step_variants("gpu"))
    single, _ = engines
    llm = LLM(**ENGINE, decode_steps=STEPS)
    counts, variants, run = StepCount(llm.llm_engine).counts, set(), llm.llm_engine.runner._run

    def spy(name, fn, fixed, args, **static):
        if name == "multi_step":
            variants.add((args[-1].use_penalties, static["filters"]))
        return run(name, fn, fixed, args, **static)
    llm.llm_engine.runner._run = spy
    filtered = [P(max_tokens=30, temperature=0.8, seed=5, top_k=20, ignore_eos=True),
                P(max_tokens=30, temperature=1.0, seed=6, top_p=0.7, min_p=0.05, logprobs=1, ignore_eos=True)]
    for sampling in (params()[:2], params()[:2] + filtered, params()[:2] + penalised()):
        prompts = [f"Example {i}:" for i in range(len(sampling))]
        assert same(outputs(llm, prompts, sampling), outputs(single, prompts, sampling))
    assert counts[STEPS] >= 15 and variants == set(step.multi_step_variants("gpu")), variants


def test_penalised_biased_and_min_tokens_rows_run_multi_step(engines):
    """The multi-step decode's penalties-and-bias variant, beside plain rows: penalised rows (their
    counts grow step by step), a logit bias, and min_tokens' ban of an ending token that greedy
    picks early (a run cut where the ban lifts); with the overlapped loop: a penalised row's tokens
    of the step before, still running, are counted on the device."""
    single, multi = engines
    counts = StepCount(multi.llm_engine).counts
    prompts = [f"Example {i}:" for i in range(6)]
    [free] = single.generate(prompts[5:], [P(max_tokens=4, temperature=0.0)], use_tqdm=False)
    banned = P(max_tokens=20, temperature=0.0, min_tokens=7, stop_token_ids=[free.outputs[0].token_ids[1]])
    sampling = params()[:2] + penalised() + [banned]
    before = CompileCounter.count
    got = outputs(multi, prompts, sampling)
    assert CompileCounter.count == before, "multi-step decoding compiled after warm-up"
    assert same(got, outputs(single, prompts, sampling))
    assert len(got[-1][0][0]) >= 7   # the ban held
    assert counts[STEPS] >= 5 and sum(counts.values()) < 22   # the 22 tokens of a penalised row
    bm = multi.llm_engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_a_constrained_row_and_new_prompts_run_one_step_at_a_time(engines):
    """A constrained row (its grammar's masks come from the host, token by token) and a prompt
    joining mid-decode make the steps single; the outputs do not change."""
    from jaxserve.structured.spec import StructuredOutput
    single, multi = engines
    engine = multi.llm_engine
    counts = StepCount(engine).counts
    constrained = P(max_tokens=14, temperature=0.7, seed=4, structured_output=StructuredOutput("regex", "[a-z ]{20}"))
    expected = {}
    for llm in engines:
        eng = llm.llm_engine
        for i, p in enumerate(params()[:2] + [constrained]):
            eng.add_request([300 + i, 17, 42 + i], p, f"r{i}")
        done, late = {}, False
        while eng.has_unfinished():
            for out in eng.step():
                done.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if not late and eng.stats["steps"] >= 6:
                late = eng.add_request([7, 8, 9], P(max_tokens=12, temperature=0.0, ignore_eos=True), "late")
        expected[llm is multi] = done
        assert sorted(done) == ["late", "r0", "r1", "r2"]
    assert expected[True] == expected[False]
    # while the constrained row ran, every step was single; after it, multi-step ones
    assert counts.get(1, 0) >= len(expected[True]["r2"]) > 0 and counts.get(STEPS, 0) >= 3
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_a_pool_short_of_pages_and_max_model_len(engines):
    """8 pages of 16 tokens for 5 sequences of 48 to 96 tokens: rows fall back to one step, or
    are preempted and recomputed, and outputs do not change; a row runs up to max_model_len."""
    sampling = [P(max_tokens=40, temperature=0.0, ignore_eos=True) for _ in range(4)]
    sampling.append(P(max_tokens=88, temperature=0.0, ignore_eos=True))   # 8 prompt tokens: max_model_len
    prompts = [f"Prompt number {i} says" for i in range(len(sampling))]
    results = []
    for steps in (1, STEPS):
        llm = LLM(**ENGINE, num_pages=8, decode_steps=steps)
        counts = StepCount(llm.llm_engine).counts
        results.append(outputs(llm, prompts, sampling))
        assert counts.get(STEPS, 0) > 0 or steps == 1
        assert llm.llm_engine.scheduler.num_preemptions > 0
        bm = llm.llm_engine.block_manager
        assert bm.num_free_pages == bm.num_pages
    assert same(results[0], results[1])
    [long] = llm.generate(prompts[-1:], sampling[-1:], use_tqdm=False)
    assert long.outputs[0].finish_reason == "length"
    assert len(long.prompt_token_ids) + len(long.outputs[0].token_ids) == ENGINE["max_model_len"]


def test_the_setting_is_checked_and_reaches_the_engine_config():
    from jaxserve import cli
    from jaxserve.config import EngineConfig
    args = cli.build_parser().parse_args(["serve", "--decode-steps", "8"])
    assert cli.engine_config(args).decode_steps == 8
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=4, speculative={"method": "ngram", "num_tokens": 3})
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)
