"""The engine on the Pallas kernels (interpret mode on CPU) gives the XLA path's greedy tokens
on a head_dim-64 model, where both flash kernels run for fresh prefill rows, with prefix-cache
hits and later chunks of long prompts taking the paged kernel for prefill rows. (The embedded
model, head_dim 32, on both kernels against the XLA path: test_kv_isolation.py.)"""
import numpy as np
import pytest

from jaxserve.config import EngineConfig

from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from tests.hf_models import save_engine_model


# Arrival step -> prompts, in steps of at most 32 tokens (two prefill step shapes in all).
# Step 0: a fresh prompt (flash), then its second chunk on a cached prefix (paged). Step 2:
# two fresh prompts beside a decode (flash with two segments + paged). Step 6: a prompt
# sharing 40 tokens with the first (prefix-cache hit: paged).
def _arrivals():
    rng = np.random.RandomState(0)
    shared = rng.randint(0, 256, 40).tolist()
    return {0: [shared + rng.randint(0, 256, 20).tolist()],
            2: [rng.randint(0, 256, 14).tolist(), rng.randint(0, 256, 16).tolist()],
            6: [shared + rng.randint(0, 256, 10).tolist()]}


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hd64"))
    save_engine_model(d, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    return d


def _greedy_staggered(model, backend):
    engine = LLMEngine(EngineConfig(model=model, attention_backend=backend, max_num_seqs=4,
                                    max_num_batched_tokens=32, prefill_chunk_size=32, max_prefill_seqs=2,
                                    max_model_len=128, num_pages=40, enable_prefix_caching=True))
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    arrivals, ids, out, step = _arrivals(), [], {}, 0
    while engine.has_unfinished() or arrivals:
        ids += [engine.add_request(p, params) for p in arrivals.pop(step, [])]
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
        step += 1
    assert engine.scheduler.prefix_hit_rate > 0
    return [out[i] for i in ids]


def test_pallas_flash_prefill_matches_xla_head_dim_64(head_dim_64_model):
    want = _greedy_staggered(head_dim_64_model, "xla")
    assert [len(t) for t in want] == [5] * 4
    for backend in ("pallas_gpu", "pallas_tpu"):
        assert _greedy_staggered(head_dim_64_model, backend) == want, backend
