"""The engine on the Pallas kernels (interpret mode on CPU) gives the XLA path's greedy tokens
on the embedded model."""
import pytest

from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.engine import LLMEngine

PROMPTS = ["The for statement in Python", "Exceptions are raised when", "x"]


def _greedy(backend):
    engine = LLMEngine(EngineConfig(attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=32,
                                    prefill_chunk_size=16, max_model_len=128, num_pages=32))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(engine.tokenizer.encode(p), params) for p in PROMPTS]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.outputs[0].token_ids
    return [out[i] for i in ids]


@pytest.fixture(scope="module")
def xla_tokens():
    return _greedy("xla")


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu"])
def test_pallas_backend_matches_xla(xla_tokens, backend):
    assert _greedy(backend) == xla_tokens
    assert all(len(t) == 6 for t in xla_tokens)
