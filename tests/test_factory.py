"""jaxserve.factory: the engine client it builds for a config. One engine here (submit, streams,
the request check at the edge, refusals); the data-parallel client runs on 8 fake devices in
tests/test_parallel.py (check "dp") and the multi-host leader and follower in
tests/test_multihost.py."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from jaxserve import factory
from jaxserve.config import DistributedConfig, EngineConfig
from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.engine_thread import EngineStoppedError, EngineThread
from jaxserve.sampling_params import InvalidRequest, SamplingParams
from tests.test_llm import ENGINE, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_single_engine_client_serves_and_checks_at_submit():
    client = factory.build_client(EngineConfig(**ENGINE))
    assert isinstance(client, EngineThread) and client.engines == [client.engine]
    client.start(warmup=False)
    try:
        hf = AutoModelForCausalLM.from_pretrained(TINY_MODEL_DIR, dtype=torch.float32).eval()
        prompts = [client.engine.tokenizer.encode(p) for p in ("The while statement", "Tuples are")]
        streams = [client.submit(p, GREEDY) for p in prompts]
        tokens = [[t for out in s for c in out.outputs for t in c.token_ids] for s in streams]
        assert tokens == [hf_greedy(hf, p, 6) for p in prompts]
        # Refused at submit, in the caller's thread: nothing reaches the engine.
        steps = client.engine.stats["steps"]
        with pytest.raises(InvalidRequest, match="maximum context length") as e:
            client.submit([5] * 500, SamplingParams(max_tokens=20))
        assert e.value.param == "prompt"
        with pytest.raises(InvalidRequest, match="prompt is empty"):
            client.submit([], GREEDY)
        assert client.engine.stats["steps"] == steps and client.num_pending == 0
    finally:
        client.shutdown()
    with pytest.raises(EngineStoppedError):
        client.submit(prompts[0], GREEDY)


def test_prompt_that_does_not_fit_the_kv_pool_is_refused_at_submit():
    # 4 pages of 16 tokens: 64 slots, while the context length (512) would allow more.
    engine = factory.build_engine(EngineConfig(**{**ENGINE, "num_pages": 4, "page_size": 16}))
    with pytest.raises(InvalidRequest, match="need 5 KV pages of 16 tokens, but the pool has 4"):
        engine.new_request(list(range(5, 55)), SamplingParams(max_tokens=20))
    engine.new_request(list(range(5, 55)), SamplingParams(max_tokens=15))   # 64 tokens: fits


def test_config_is_checked_when_built():
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="data-parallel replicas"):
        EngineConfig(mesh={"data": 2}, distributed=DistributedConfig("h:1", 2, 0))
    with pytest.raises(ValueError, match="data-parallel replicas .* come from build_client"):
        factory.build_engine(EngineConfig(mesh={"data": 2}))
    cfg = EngineConfig(distributed={"coordinator_address": "h:1", "num_processes": 2, "process_id": 1})
    assert cfg.distributed == DistributedConfig("h:1", 2, 1) and not cfg.distributed.is_leader
