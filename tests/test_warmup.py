"""Warm-up in the background (jaxserve/warmup.py): before the smaller step shapes are built, every
batch runs padded into the largest ones; before, while and after the background thread builds
them, greedy outputs equal the reference forward's (itself checked against transformers in
test_engine.py), seeded sampling draws the same tokens, and the serving thread compiles nothing."""
import threading

import numpy as np
import pytest

from jaxserve import cli, warmup
from jaxserve.buckets import Buckets, cover, largest
from jaxserve.checkpoint import load_params
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.generate import greedy_generate
from jaxserve.sampling_params import SamplingParams
from tests.hf_models import save_engine_model

# 5 step shapes: decode 1, 2 and 4 rows, prefill 16 and 32 tokens; built first: decode-4 and prefill-32.
SMALL = dict(max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=1,
             max_model_len=128, num_pages=64, page_size=8, compilation_cache_dir=None)
LENGTHS = [5, 40, 17, 9, 60, 3]   # six prompts, four running at most: 1 to 4 decode rows, chunked prefills
MAX_TOKENS = [8, 12, 6, 10, 5, 9]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("warmup_model"))
    save_engine_model(d)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, 256, n).tolist() for n in LENGTHS]
    cfg = ModelConfig.from_pretrained(d)
    ref = greedy_generate(cfg, load_params(d, cfg), prompts, max(MAX_TOKENS))
    return d, prompts, [r[:m] for r, m in zip(ref, MAX_TOKENS)]


def _serve(engine, prompts):
    """Each prompt greedy and seeded-sampled (with logprobs), all at once; (greedy token ids,
    sampled (token id, SampleResult) pairs) per prompt."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=m, logprobs=1, ignore_eos=True)
               for i, m in enumerate(MAX_TOKENS)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts + prompts, params)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.outputs:
                out[o.request_id] += list(zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
    greedy = [[t for t, _ in out[i]] for i in ids[:len(prompts)]]
    return greedy, [out[i] for i in ids[len(prompts):]]


def _step_tokens(runner) -> list[int]:
    """Records the token count of every step the runner runs from now on."""
    seen, get = [], runner.executables.get

    def recording(k):
        if k[0] == "step":
            seen.append(k[1][0][0][0])   # the tokens array's length
        return get(k)
    runner.executables.get = recording
    return seen


def test_serving_while_warm_up_builds_in_the_background(setup, monkeypatch):
    d, prompts, ref = setup
    gate = threading.Event()   # holds the background thread until the first round is served
    build = warmup._build

    def gated(*args, **kwargs):
        if threading.current_thread().name == "jaxserve-warmup":
            gate.wait()
        return build(*args, **kwargs)
    monkeypatch.setattr(warmup, "_build", gated)
    engine = LLMEngine(EngineConfig(model=d, **SMALL))
    runner = engine.runner
    shapes = runner.buckets.warmup_shapes(False)
    assert [s.name for s in largest(shapes)] == ["decode-4", "prefill-32x1q32"] and len(shapes) == 5

    engine.warmup(background=True)
    assert runner.ready_shapes == frozenset(largest(shapes)) and runner.background_warmup.pending == 3
    serving_compiles = CompileCounter.on_this_thread()
    steps = _step_tokens(runner)
    greedy, sampled = _serve(engine, prompts)
    assert greedy == ref
    assert set(steps) == {4, 32}   # everything padded into the two shapes built
    assert CompileCounter.on_this_thread() == serving_compiles

    gate.set()   # the other three shapes are built while this round runs
    during, sampled_during = _serve(engine, prompts)
    assert runner.wait_warm(timeout=600) and runner.ready_shapes is None
    assert runner.background_warmup.pending == 0
    steps.clear()
    after, sampled_after = _serve(engine, prompts)
    assert during == after == ref
    assert {1, 2, 16} <= set(steps)   # the smaller shapes now run
    for a, b, c in zip(sampled, sampled_during, sampled_after):
        assert [t for t, _ in a] == [t for t, _ in b] == [t for t, _ in c]
        np.testing.assert_allclose([r.logprob for _, r in a], [r.logprob for _, r in c], rtol=1e-4, atol=1e-5)
    assert CompileCounter.on_this_thread() == serving_compiles   # the background thread compiled them all
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_step_shapes_largest_builds_and_runs_only_the_two_largest(setup):
    d, prompts, ref = setup
    engine = LLMEngine(EngineConfig(model=d, step_shapes="largest", **SMALL))
    runner = engine.runner
    assert [s.name for s in runner.buckets.warmup_shapes(False)] == ["decode-4", "prefill-32x1q32"]
    engine.warmup(background=True)   # nothing is left for a background thread
    assert runner.background_warmup is None and runner.wait_warm(timeout=0)
    # Two step programs built ("all": 5). In a process of its own, 9 compilations in all against 23.
    assert sum(k[0] == "step" for k in runner.executables.table) == 2
    warm = CompileCounter.count
    steps = _step_tokens(runner)
    greedy, _ = _serve(engine, prompts)
    assert greedy == ref
    assert set(steps) == {4, 32} and CompileCounter.count == warm
    assert runner.ready_shapes == frozenset(largest(Buckets(EngineConfig(**SMALL)).warmup_shapes(False)))
    with pytest.raises(ValueError, match="step_shapes must be all or largest"):
        EngineConfig(step_shapes="smallest")
    parser = cli.build_parser()
    assert cli.engine_config(parser.parse_args(["serve", "--step-shapes", "largest"])).step_shapes == "largest"
    assert cli.engine_config(parser.parse_args(["serve"])).step_shapes == "all"


def test_cover_picks_the_smallest_ready_shape_that_holds_the_batch():
    buckets = Buckets(EngineConfig(model=None, max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_size=128,
                                   max_prefill_seqs=2))
    shapes = buckets.warmup_shapes(False)
    first = frozenset(largest(shapes))
    assert {s.name for s in first} == {"decode-16", "prefill-128x2q128"}
    for s in shapes:   # every shape fits the largest of its family, and is itself once built
        assert cover(s, first) == max((f for f in first if bool(f.prefill_rows) == bool(s.prefill_rows)))
        assert cover(s, first | {s}) == s and cover(s, None) == s
    by_name = {s.name: s for s in shapes}
    ready = first | {by_name["decode-4"], by_name["prefill-64x1q32"], by_name["prefill-64x2q64"]}
    assert cover(by_name["decode-2"], ready).name == "decode-4"
    assert cover(by_name["decode-8"], ready).name == "decode-16"
    assert cover(by_name["prefill-32x1q32"], ready).name == "prefill-64x1q32"
    assert cover(by_name["prefill-64x2q32"], ready).name == "prefill-64x2q64"
    assert cover(by_name["prefill-64x1q64"], ready).name == "prefill-64x2q64"
    assert cover(by_name["prefill-128x1q32"], ready).name == "prefill-128x2q128"
    # With speculation, the largest of each decode width; a plain batch keeps the plain width,
    # also where a verify-width prefill shape holds as many tokens.
    spec = Buckets(EngineConfig(model=None, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32,
                                max_prefill_seqs=1, speculative={"method": "ngram", "num_tokens": 3}))
    first = largest(spec.warmup_shapes(False))
    assert [s.name for s in first] == ["decode-8", "decode-8v4", "prefill-64x1q32", "prefill-64x1q32v4"]
    for s in spec.warmup_shapes(False):
        assert cover(s, frozenset(first)).decode_q == s.decode_q


def test_decode_buckets_start_at_8_rows_and_double_on_tpu_and_gpu():
    wide, narrow = (EngineConfig(model=None, max_num_seqs=n) for n in (128, 4))
    assert Buckets(wide).decode == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]   # CPU: every row costs
    for platform in ("tpu", "gpu"):
        assert Buckets(wide, platform=platform).decode == [8, 16, 32, 64, 128]
        assert Buckets(narrow, platform=platform).decode == [4]


def test_pallas_steps_with_prefill_come_one_per_token_bucket():
    """The Pallas kernels take ragged rows: a step with prefill rows pads to all max_prefill_seqs
    rows and the chunk size, one shape per token bucket; the XLA path keeps its prefill-row and
    max_q buckets. Every XLA shape's batch fits the ragged shape of its token bucket."""
    cfg = EngineConfig(model=None, max_num_seqs=16, max_num_batched_tokens=128, prefill_chunk_size=64,
                       max_prefill_seqs=4)
    xla = Buckets(cfg).warmup_shapes(False)
    ragged = Buckets(cfg, backend="pallas_gpu").warmup_shapes(False)   # as a CPU interpreting the kernels
    assert [s for s in ragged if not s.prefill_rows] == [s for s in xla if not s.prefill_rows]
    assert [s.name for s in ragged if s.prefill_rows] == [f"prefill-{t}x4q{min(t, 64)}" for t in (16, 32, 64, 128)]
    assert len([s for s in xla if s.prefill_rows]) == 18   # 1, 2 and 4 rows; max_q 32 and the chunk
    # On a TPU or GPU, from 128 tokens (PlatformBuckets): fewer cost as much
    assert [s.tokens for s in Buckets(cfg, platform="tpu", backend="pallas_tpu").warmup_shapes(False)
            if s.prefill_rows] == [128]
    for s in xla:
        assert cover(s, frozenset(ragged)).tokens == s.tokens
