"""Engine: continuous batching, chunked prefill, preemption and prefix caching leave greedy
outputs unchanged (vs the reference path and transformers), and every page comes back."""
import dataclasses

import numpy as np
import pytest
import torch

from jaxserve.checkpoint import load_params
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import LLMEngine
from jaxserve.generate import greedy_generate
from jaxserve.sampling_params import SamplingParams
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


def _collect(engine, requests):
    """requests: list of (prompt, SamplingParams). Returns per request {index: (tokens, text, reason, logprobs)}."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    acc: dict[str, dict[int, list]] = {i: {} for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.outputs:
                slot = acc[o.request_id].setdefault(c.index, [[], "", None, []])
                slot[0] += c.token_ids
                slot[1] += c.text
                slot[2] = c.finish_reason or slot[2]
                slot[3] += c.logprobs or []
    return [acc[i] for i in ids]


@pytest.fixture(scope="module")
def engine(setup):
    return _engine(setup[0])


def test_seeded_sampling_same_in_any_batch(setup, engine):
    _, _, prompts, _ = setup
    target = (prompts[2], SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True))
    alone = _collect(engine, [target])[0][0][0]
    others = [(p, SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True))
              for p, m in zip(prompts[4:9], MAX_TOKENS)]
    crowded = _collect(engine, others[:3] + [target] + others[3:])[3][0][0]
    assert alone == crowded
    other_seed = _collect(engine, [(target[0], SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                              max_tokens=12, ignore_eos=True))])[0][0][0]
    assert other_seed != alone


def test_n_choices_fork_and_copy_on_write(setup, engine):
    _, _, prompts, ref = setup
    greedy = _collect(engine, [(prompts[4], SamplingParams(temperature=0.0, n=2, max_tokens=10, ignore_eos=True))])[0]
    assert greedy[0][0] == greedy[1][0] == ref[4][:10]
    sampled = _collect(engine, [(prompts[4], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=10,
                                                            ignore_eos=True))])[0]
    assert sorted(sampled) == [0, 1, 2] and all(len(sampled[i][0]) == 10 for i in range(3))
    assert len({tuple(sampled[i][0]) for i in range(3)}) == 3
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_stop_token_and_stop_string(setup, engine):
    _, _, prompts, ref = setup
    tokens = ref[1]
    out = _collect(engine, [(prompts[1], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[tokens[6]],
                                                        ignore_eos=True))])[0][0]
    first = tokens.index(tokens[6])
    assert out[0] == tokens[:first + 1] and out[2] == "stop"   # the stop token among them, as in vLLM
    full = _collect(engine, [(prompts[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))])[0][0]
    assert full[2] == "length" and full[0] == tokens
    text = full[1]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = _collect(engine, [(prompts[1], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                        ignore_eos=True))])[0][0]
    assert cut[1] == text[:text.index(stop)] and cut[2] == "stop"


def test_logprobs_match_reference(setup, engine):
    d, _, prompts, _ = setup
    cfg = ModelConfig.from_pretrained(d)
    _, logits = greedy_generate(cfg, load_params(d, cfg), [prompts[0]], 6, return_logits=True)
    out = _collect(engine, [(prompts[0], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3,
                                                        ignore_eos=True))])[0][0]
    ref_lp = torch.log_softmax(torch.tensor(logits[0]), -1).numpy()
    for step, res in enumerate(out[3]):
        assert abs(res.logprob - ref_lp[step, res.token]) < 1e-4
        top = np.argsort(-ref_lp[step])[:3]
        assert [t for t, _ in res.top] == top.tolist()
        assert np.allclose([lp for _, lp in res.top], ref_lp[step, top], atol=1e-4)


def test_abort_frees_pages(setup, engine):
    _, _, prompts, _ = setup
    keep = engine.add_request(prompts[3], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    gone = engine.add_request(prompts[7], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    final = engine.abort(gone)
    assert final.finished and final.outputs[0].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.abort(keep) is None
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_no_compilation_after_warmup(setup):
    from jaxserve.compilations import CompileCounter

    d, _, _, _ = setup
    engine = _engine(d, max_num_seqs=4, max_num_batched_tokens=32, prefill_chunk_size=16, max_model_len=128,
                     max_prefill_seqs=2, num_pages=12)
    engine.warmup()
    before = CompileCounter.count
    rng = np.random.RandomState(3)
    requests = [(rng.randint(0, 256, n).tolist(),
                 SamplingParams(temperature=t, max_tokens=m, n=k, logprobs=lp, repetition_penalty=rp, seed=i,
                                ignore_eos=True))
                for i, (n, m, t, k, lp, rp) in enumerate([
                    (3, 5, 0.0, 1, None, 1.0), (100, 20, 0.7, 1, 2, 1.0), (40, 30, 0.0, 2, None, 1.2),
                    (17, 60, 1.0, 1, None, 1.0), (64, 10, 0.0, 1, 5, 1.0), (9, 40, 0.5, 3, None, 1.1),
                    (1, 12, 0.0, 1, None, 1.0), (80, 25, 0.0, 1, None, 1.0)])]
    # A logit bias, and min_tokens (which bans the stop token by a bias while it holds).
    requests[3] = (requests[3][0], dataclasses.replace(requests[3][1], logit_bias={5: 2.0, 9: -1.0}))
    requests[6] = (requests[6][0], dataclasses.replace(requests[6][1], min_tokens=6, stop_token_ids=[7]))
    # Prompt logprobs (chunked prefills of 64 and 80 tokens), one scoring the prompt only.
    requests[4] = (requests[4][0], dataclasses.replace(requests[4][1], prompt_logprobs=3))
    requests[7] = (requests[7][0], dataclasses.replace(requests[7][1], prompt_logprobs=0, max_tokens=0))
    for i in range(0, len(requests), 3):  # arrivals in waves: batch sizes and lengths vary
        _collect(engine, requests[i:i + 3] + requests[:i % 2])
    assert engine.scheduler.num_preemptions > 0  # the small pool forced preemption on the way
    assert CompileCounter.count == before
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_overlapped_loop_stops_found_late_and_aborts_in_flight(setup):
    """Stop tokens found one step late (the sequence's next row already launched), max_tokens and
    an abort while a step runs: outputs equal the reference, and every page comes back."""
    d, _, prompts, ref = setup
    engine = _engine(d)
    assert engine.overlap
    stops = {i: r[3] for i, r in enumerate(ref) if len(r) > 4 and r[3] not in r[:3]}
    assert len(stops) > 4
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=len(r), ignore_eos=True,
                                                stop_token_ids=[stops[i]] if i in stops else []))
           for i, (p, r) in enumerate(zip(prompts, ref))]
    out = {i: ([], None) for i in ids}
    in_flight = 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + o.outputs[0].token_ids, o.outputs[0].finish_reason)
        in_flight += engine._inflight is not None
        if in_flight == 3:
            engine.abort(ids[1])   # its row is in the step just launched
    assert in_flight > 3   # steps were launched before the previous one was collected
    for i, (rid, r) in enumerate(zip(ids, ref)):
        if i == 1:
            continue
        expected = (r[:4], "stop") if i in stops else (r, "length")
        assert out[rid] == expected, i
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages
