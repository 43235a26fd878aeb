"""Speculative decoding with a draft model (jaxserve/spec_decode/draft.py) on the embedded pair:
outputs identical with the draft on and off (greedy through preemption and prefix-cache hits,
seeded sampling with n = 2 forks), greedy equal to transformers, every proposal the draft
model's own greedy continuation of the sequence (transformers' draft model over the known
tokens: the draft's paged KV kept in step through rollback, preemption, forks, prefix hits and
steps the throttle kept plain), and sampled tokens that follow the target's distribution."""
import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxserve import SamplingParams, sizing
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.spec_decode.draft import default_draft_dir, draft_model
from tests.target_distribution import DRAWS, chi_square_p, exact_triples, sampled_triples
from tests.test_spec_decode import CASES, PROMPTS, _run, check_throttled_run, plain_llm, plain_outputs, warm_llm

DRAFT = {"method": "draft", "num_tokens": 3, "disable_by_batch_size": 8}   # as test_spec_decode.SPEC
DRAFT_DIR = os.path.join(TINY_MODEL_DIR, "draft")


def test_config_is_checked(tmp_path):
    ecfg = EngineConfig(speculative=DRAFT)
    spec, target = ecfg.speculative, ModelConfig.from_pretrained(TINY_MODEL_DIR)
    assert (spec.method, spec.model, spec.num_tokens) == ("draft", None, 3)
    assert default_draft_dir(TINY_MODEL_DIR, TINY_MODEL_DIR) == DRAFT_DIR
    with pytest.raises(ValueError, match="needs `model`"):
        default_draft_dir("/models/other", TINY_MODEL_DIR)
    with pytest.raises(ValueError, match="is for method draft"):
        EngineConfig(speculative={"method": "ngram", "model": DRAFT_DIR})
    assert draft_model(EngineConfig(), TINY_MODEL_DIR, target, TINY_MODEL_DIR) is None
    draft = draft_model(ecfg, TINY_MODEL_DIR, target, TINY_MODEL_DIR)
    assert (draft.dir, draft.cfg, draft.quantization, draft.quantize_lm_head) == (
        DRAFT_DIR, ModelConfig.from_pretrained(DRAFT_DIR), None, False)
    with pytest.raises(ValueError, match="draft must share the target's tokenizer"):
        draft_model(ecfg, TINY_MODEL_DIR, dataclasses.replace(target, vocab_size=target.vocab_size + 1),
                    TINY_MODEL_DIR)
    # a draft stored quantized (here an AWQ config.json) is held so, as loading it does
    config = json.load(open(os.path.join(DRAFT_DIR, "config.json")))
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    stored = draft_model(EngineConfig(speculative={**DRAFT, "model": str(tmp_path)}), "/models/other", target,
                         TINY_MODEL_DIR)
    assert stored.quantization == "int4_asym"
    assert draft_model(EngineConfig(speculative={**DRAFT, "model": str(tmp_path)}, quantization="int8"),
                       "/models/other", target, TINY_MODEL_DIR).quantization == "int8"


def test_accelerator_pool_leaves_room_for_the_draft():
    """On an accelerator the target's pool is sized before the draft loads, and the draft's own
    pool gets as many pages: the draft's weights come off the free HBM and each page costs the
    target's and the draft's K/V (bf16: 2 bytes x 2 (K, V) x layers x KV heads x head_dim x slots)."""
    target = ModelConfig.from_pretrained(TINY_MODEL_DIR)
    ecfg = EngineConfig(page_size=16, speculative=DRAFT)
    drafted = draft_model(ecfg, TINY_MODEL_DIR, target, TINY_MODEL_DIR)
    draft = drafted.cfg
    hbm, used = 2 ** 31, 2 ** 28

    def pages(**kw):
        return sizing.kv_pool_pages(target, ecfg, jnp.bfloat16, model_axis=1, hbm_bytes=hbm, used_bytes=used,
                                    tpu=False, chip="h100", name="tiny", **kw)

    def page_bytes(c):
        return 2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 16

    assert pages() == int((hbm - used) * ecfg.kv_memory_fraction) // page_bytes(target)
    got = pages(draft=drafted)
    draft_weights = 2 * draft.num_params   # bf16
    both = page_bytes(target) + page_bytes(draft)
    assert got == int((hbm - used - draft_weights) * ecfg.kv_memory_fraction) // both
    assert got * both + draft_weights <= hbm - used


@pytest.fixture(scope="module")
def engines():
    """(plain, draft-speculating) LLMs on the embedded model, both warmed up."""
    return plain_llm(), warm_llm(DRAFT)


def _hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="float32").eval()


@pytest.fixture(scope="module")
def hf_draft():
    return _hf(DRAFT_DIR)


def _record_proposals(engine, monkeypatch) -> list:
    """Every verify row's (known tokens, proposals) as the draft proposer fills them."""
    records, propose = [], engine.draft.propose

    def spy(out):
        steps = propose(out)
        records.extend((s.seq.token_ids, list(s.seq.proposed_token_ids)) for s in out.scheduled if s.num_sampled > 1)
        return steps
    monkeypatch.setattr(engine.draft, "propose", spy)
    return records


def _check_greedy_continuations(hf_draft, records):
    """Each run of proposals is the draft model's greedy continuation of the tokens before it
    (transformers, float32, one forward over the tokens and the proposals); where it is not,
    the two best tokens were within float error of each other. Every third verify row: a few
    hundred forwards would take minutes on the shared 2-core box."""
    assert records
    for tokens, proposals in records[::3]:
        with torch.no_grad():
            logits = hf_draft(torch.tensor([tokens + proposals[:-1]])).logits[0, len(tokens) - 1:].double().numpy()
        for row, proposal in zip(logits, proposals):
            assert proposal == int(np.argmax(row)) or row.max() - row[proposal] < 1e-4, (tokens, proposals)


@pytest.mark.parametrize("case", CASES)
def test_same_outputs_with_and_without_the_draft(engines, hf_draft, monkeypatch, case):
    _, draft = engines
    params = CASES[case]
    engine = draft.llm_engine
    stats, before = engine.stats, dict(engine.stats)
    preemptions, hits = engine.scheduler.num_preemptions, engine.block_manager.prefix_hit_tokens
    records = _record_proposals(engine, monkeypatch)
    compiles = CompileCounter.count
    assert _run(draft, params) == plain_outputs(case)
    assert CompileCounter.count == compiles   # every draft and verify shape was compiled at warm-up
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    assert stats["spec_draft_steps"] > before["spec_draft_steps"]
    _check_greedy_continuations(hf_draft, records)
    if case == "greedy":   # 6 x 160 tokens in 24 pages of 16: preempted, then re-admitted on cached pages
        assert engine.scheduler.num_preemptions > preemptions
        assert engine.block_manager.prefix_hit_tokens > hits


def test_throttle_switches_the_draft_off_and_on(engines, hf_draft, monkeypatch):
    """As tests/test_spec_decode.py's test of the same name; the proposals after speculation
    resumes are the draft's greedy continuations: its K/V caught up with the tokens the target
    decoded meanwhile."""
    engine = engines[1].llm_engine
    records, steps = _record_proposals(engine, monkeypatch), engine.stats["spec_draft_steps"]
    check_throttled_run(engines[1], monkeypatch)
    assert engine.stats["spec_draft_steps"] > steps
    _check_greedy_continuations(hf_draft, records)


def test_greedy_equals_transformers(engines):
    _, draft = engines
    target = _hf(TINY_MODEL_DIR)
    for prompt in PROMPTS[:3]:
        ids = draft.get_tokenizer().encode(prompt)
        with torch.no_grad():
            expected = target.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False)
        [out] = draft.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=48,
                                                                          ignore_eos=True), use_tqdm=False)
        assert out.outputs[0].token_ids == expected[0, len(ids):].tolist()


def test_sampled_tokens_follow_the_targets_distribution(engines):
    """As tests/test_spec_decode.py's test of the same name, with the draft model's proposals
    (greedy: a certain proposal, q one-hot) and top-k and top-p set."""
    _, draft = engines
    filters = dict(top_k=6, top_p=0.8)
    prompt = draft.get_tokenizer().encode("The with statement")
    counts, proposed, accepted = sampled_triples(draft, prompt, filters)
    assert proposed >= DRAWS and accepted > 0
    target = _hf(TINY_MODEL_DIR)
    assert chi_square_p(counts, exact_triples(target, prompt, 1.0, **filters), DRAWS) > 1e-3
    assert chi_square_p(counts, exact_triples(target, prompt, 2.0, **filters), DRAWS) < 1e-6
