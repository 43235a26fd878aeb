"""Engine: continuous batching, chunked prefill, preemption and prefix caching leave greedy
outputs unchanged (vs the reference path and transformers), and every page comes back."""
import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_params
from jaxserve.config import EngineConfig, ModelConfig, SamplingParams
from jaxserve.engine import LLMEngine
from jaxserve.generate import greedy_generate
from tests.hf_models import save_engine_model

LENGTHS = [5, 300, 17, 64, 33, 120, 9, 250, 48, 16, 31, 200, 6, 90, 150, 12]
MAX_TOKENS = [8, 20, 5, 30, 12, 16, 25, 3, 18, 10, 22, 7, 14, 28, 9, 11]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("engine_model"))
    hf = save_engine_model(d)
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 256, 40).tolist()  # a common prefix for the prefix cache to find
    prompts = [(shared + rng.randint(0, 256, n).tolist())[:n] if i in (3, 5, 11, 13) else rng.randint(0, 256, n).tolist()
               for i, n in enumerate(LENGTHS)]
    cfg = ModelConfig.from_pretrained(d)
    ref = greedy_generate(cfg, load_params(d, cfg), prompts, max(MAX_TOKENS))
    ref = [r[:m] for r, m in zip(ref, MAX_TOKENS)]
    return d, hf, prompts, ref


def _engine(d, **kw):
    base = dict(model=d, max_num_seqs=16, max_num_batched_tokens=64, prefill_chunk_size=64,
                max_model_len=512, num_pages=160)
    base.update(kw)
    return LLMEngine(EngineConfig(**base))


def _run(engine, prompts, stagger=0):
    """Submit all prompts (the second half after `stagger` steps) and run to completion."""
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    half = len(prompts) // 2 if stagger else len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:half], params[:half])]
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished() or len(ids) < len(prompts):
        if steps == stagger and len(ids) < len(prompts):
            ids += [engine.add_request(p, sp) for p, sp in zip(prompts[half:], params[half:])]
        for o in engine.step():
            for c in o.outputs:
                out.setdefault(o.request_id, []).extend(c.token_ids)
        steps += 1
    return [out[i] for i in ids]


def test_reference_matches_transformers(setup):
    _, hf, prompts, ref = setup
    for p, r in zip(prompts[:6], ref[:6]):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=len(r), min_new_tokens=len(r), do_sample=False)
        assert g[0, len(p):].tolist() == r


@pytest.mark.parametrize("kw,stagger", [
    (dict(), 0),
    (dict(prefill_chunk_size=16, enable_prefix_caching=False), 3),
    (dict(prefill_chunk_size=64, enable_prefix_caching=True), 5),
])
def test_engine_greedy_matches_reference(setup, kw, stagger):
    d, _, prompts, ref = setup
    engine = _engine(d, **kw)
    assert _run(engine, prompts, stagger) == ref
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
    caching = kw.get("enable_prefix_caching", True)
    if not caching:
        assert engine.scheduler.prefix_hit_rate == 0
    elif stagger:  # late arrivals find the shared prefix already cached
        assert engine.scheduler.prefix_hit_rate > 0


def test_preemption_keeps_outputs(setup):
    d, _, prompts, ref = setup
    engine = _engine(d, num_pages=40, prefill_chunk_size=16)  # 640 slots for ~1800 tokens of demand
    assert _run(engine, prompts, stagger=2) == ref
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
