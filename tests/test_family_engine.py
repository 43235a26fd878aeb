"""Every registered architecture served through the engine, as users load it (`LLM(model=DIR)`):
paged KV cache, prompts split into chunks, a shared prefix found in the prefix cache. Greedy
continuations must equal transformers' generate on the same seeded checkpoint."""
import numpy as np
import pytest
import torch
import transformers as tf

from jaxserve import LLM, SamplingParams
from tests.hf_models import CONFIGS, save_byte_tokenizer, save_hf_model

NEW_TOKENS = 24
# Small buckets (few compilations); 16-token chunks split every prompt; 8-token pages let the
# second prompt find the first one's 32-token prefix in the cache.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=16, max_prefill_seqs=1,
              page_size=8, max_model_len=128, num_pages=64, enable_prefix_caching=True,
              compilation_cache_dir=None)


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, vocab, 36).tolist()
    return [shared + rng.integers(0, vocab, 5).tolist(), shared + rng.integers(0, vocab, 11).tolist(),
            rng.integers(0, vocab, 21).tolist()]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_greedy_matches_transformers(name, tmp_path):
    hf = save_hf_model(name, str(tmp_path))
    save_byte_tokenizer(str(tmp_path))
    prompts = _prompts(hf.config.vocab_size)
    # No eos: like ignore_eos, generation runs through it (min_new_tokens would ban it instead).
    hf.generation_config.eos_token_id = None
    greedy = tf.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    expected = []
    for p in prompts:
        ids = torch.tensor([p])   # the mask is explicit: generate would mask a prompt's pad-id tokens
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)
        expected.append(out[0, len(p):].tolist())

    llm = LLM(model=str(tmp_path), **ENGINE)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate(prompts[:1], sp)          # fills the prefix cache for the second prompt
    rest = llm.generate(prompts[1:], sp)
    assert [o.outputs[0].token_ids for o in first + rest] == expected, name
    assert llm.llm_engine.block_manager.prefix_hit_rate > 0   # the shared prefix came from the cache
    assert len({tuple(e) for e in expected}) == len(prompts)  # continuations differ
