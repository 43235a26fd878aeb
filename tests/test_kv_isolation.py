"""No request reads K/V it did not write, and the engine on the Pallas kernels (interpret mode on
CPU) gives the XLA path's outputs. With EngineConfig.poison_freed_pages, every page freed or newly
taken is filled with NaN before the next step, so any read of another request's (or a stale) page
would turn outputs NaN or change them. Greedy tokens and logprobs must equal those of the XLA path
without poisoning (bit for bit on that path, within float error on the Pallas kernels), through
chunked prefill, prefix-cache hits, n > 1 forks and preemption. Head dim 64: on both Pallas
backends the first chunk of a prompt without a cached prefix takes the flash kernel, later chunks
and prefix-cache hits the paged kernel for prefill rows (several fresh rows in one flash call:
test_paged_attention.py's attend tests)."""
import functools

import numpy as np
import pytest

from jaxserve.config import EngineConfig

from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from tests.hf_models import save_engine_model

MAX_TOKENS = 6
ATOL = 1e-4


# Arrival step -> (prompt, n). Prompts are longer than prefill_chunk_size (chunked prefill); the
# later ones share the first's 40-token prefix (prefix-cache hits); 6 pages of 16 tokens cannot
# hold them all at once (preemption).
def _arrivals():
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 256, 40).tolist()
    return {0: [(shared + rng.randint(0, 256, 4).tolist(), 2)],
            3: [(shared + rng.randint(0, 256, 6).tolist(), 1), (rng.randint(0, 256, 20).tolist(), 1)]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 2-layer model (the embedded one has 6): the Pallas kernels run in interpret mode, inlined
    once per layer. Two, not one: only through the second layer's K/V do the first layer's
    outputs for tokens before a prompt's last (a flash row's, a poisoned read's) reach the logits.
    2 heads of 64 on one KV head: both flash kernels take head_dim 64 interpreted."""
    path = str(tmp_path_factory.mktemp("model"))
    save_engine_model(path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return path


def _run(model, backend, poison, kv_cache_dtype="auto", decode_steps=1):
    engine = LLMEngine(EngineConfig(model=model, attention_backend=backend, max_num_seqs=4,
                                    max_num_batched_tokens=16, prefill_chunk_size=16, max_prefill_seqs=1,
                                    max_model_len=128, num_pages=6, poison_freed_pages=poison, step_shapes="largest",
                                    kv_cache_dtype=kv_cache_dtype, decode_steps=decode_steps))
    launch, multi_steps = engine._launch, []
    engine._launch = lambda o: (multi_steps.append(o.decode_steps > 1), launch(o))[1]
    arrivals, ids, out, step = _arrivals(), [], {}, 0
    while engine.has_unfinished() or arrivals:
        for prompt, n in arrivals.pop(step, []):
            params = SamplingParams(temperature=0.0, n=n, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
            ids.append(engine.add_request(prompt, params))
        for o in engine.step():
            for c in o.outputs:
                got = out.setdefault((o.request_id, c.index), ([], []))
                got[0].extend(c.token_ids)
                got[1].extend(r.logprob for r in c.logprobs)
        step += 1
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.prefix_hit_rate > 0
    assert any(multi_steps) == (decode_steps > 1)
    layer = engine.runner.kv_cache.layers[0]   # a quantized cache's poison shows in its scales
    k, v = (np.asarray(x) for x in ((layer.k, layer.v) if layer.k_scale is None else (layer.k_scale, layer.v_scale)))
    # Poisoned slots left: of freed pages, and of taken pages past what their sequence wrote (the
    # ended sequences' last pages stay cached: jaxserve/block_manager.py's partial pages).
    nan_values = sum(int(np.isnan(x).sum()) for x in (k, v))
    keys = sorted(out)
    return ([out[key][0] for key in keys], np.array([out[key][1] for key in keys], np.float32)), nan_values


@functools.cache
def _clean_xla_run(model, kv_cache_dtype):
    return _run(model, "xla", poison=False, kv_cache_dtype=kv_cache_dtype)


# Each backend and each pool dtype once. An int8 cache: the poison reaches it through the scales
# (the Pallas kernels' reads of quantized pools past what rows may see, NaN scales there included:
# test_paged_attention.py and test_gpu_kernels.py). decode_steps 3: multi-step decodes
# (jaxserve/step.py) read and write pages a step ahead of what the host has seen.
@pytest.mark.parametrize("backend, kv_cache_dtype, decode_steps",
                         [("xla", "auto", 1), ("pallas_tpu", "auto", 1), ("pallas_gpu", "auto", 1), ("xla", "int8", 1),
                          ("xla", "auto", 3)])
def test_poisoned_free_pages_leave_outputs_unchanged(model, backend, kv_cache_dtype, decode_steps):
    (tokens, logprobs), clean_nan_values = _clean_xla_run(model, kv_cache_dtype)
    (poisoned_tokens, poisoned_logprobs), nan_values = _run(model, backend, poison=True, kv_cache_dtype=kv_cache_dtype,
                                                            decode_steps=decode_steps)
    assert clean_nan_values == 0 and nan_values > 0      # the poison was there to be read
    assert [len(t) for t in tokens] == [MAX_TOKENS] * 4
    assert poisoned_tokens == tokens
    assert np.isfinite(logprobs).all() and np.isfinite(poisoned_logprobs).all()
    if backend == "xla" and decode_steps == 1:
        assert np.array_equal(poisoned_logprobs, logprobs)
    else:   # another request's live page would move logprobs far more than this
        np.testing.assert_allclose(poisoned_logprobs, logprobs, rtol=0, atol=ATOL)
