"""The family tests' engine run (tests/test_family_engine.py, test_moe.py, test_deepseek.py,
test_expert_parallel.py): the engine settings, three prompts, two of them on a shared prefix, and
the engine's greedy tokens of them. Without torch: test_expert_parallel.py's subprocess imports it."""
import numpy as np

from jaxserve import LLM, SamplingParams

NEW_TOKENS = 24
# Small buckets (few compilations); 16-token chunks split every prompt; 8-token pages let the
# second prompt find the first one's 32-token prefix in the cache.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, prefill_chunk_size=16, max_prefill_seqs=1,
              page_size=8, max_model_len=128, num_pages=64, enable_prefix_caching=True,
              compilation_cache_dir=None, step_shapes="largest")


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(3)
    shared = rng.integers(0, vocab, 36).tolist()
    return [shared + rng.integers(0, vocab, 5).tolist(), shared + rng.integers(0, vocab, 11).tolist(),
            rng.integers(0, vocab, 21).tolist()]


def engine_tokens(model_dir: str, llm: LLM | None = None, **engine) -> tuple[list[list[int]], float]:
    """Greedy tokens of the prompts (the first run alone, filling the prefix cache), and the
    prefix-cache hit rate; llm: an engine already made of the model (None: one of ENGINE, engine)."""
    llm = llm or LLM(model=model_dir, **ENGINE, **engine)
    prompts = _prompts(llm.llm_engine.model_cfg.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts[:1], sp, use_tqdm=False) + llm.generate(prompts[1:], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.block_manager.prefix_hit_rate
