"""One of two local processes serving one engine through jax.distributed (2 CPU devices each,
tensor parallel over the 4 global devices), run by tests/test_multihost.py:
  XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
  python -m tests.multihost_worker MODEL_DIR 127.0.0.1:PORT PROCESS_ID
Both processes build their engine client through jaxserve.factory from the same EngineConfig
(but for the process id) and warm it up: process 0 gets an EngineThread and serves WAVES
(idle between the waves, so the follower is parked and woken once), then shuts it down;
process 1 gets a Follower. Each prints one JSON line: the steps it ran, and on process 0 the
samplers it sent on their own (structured output in the overlapped loop), the multi-step decodes
it ran (decode_steps 3: while both seats decode, penalised rows too) and every request's tokens and
logprobs."""
import dataclasses
import json
import os
import sys
import tempfile
import time

import jax

from jaxserve import factory
from jaxserve.config import DistributedConfig, EngineConfig
from jaxserve.engine_thread import EngineThread
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured import StructuredOutput

# Small buckets: warm-up compiles 12 shapes (3 steps, 8 samplers, the page copy), kept between runs
# in the persistent cache the server tests use.
ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=16, max_prefill_seqs=1,
              max_model_len=96, page_size=8, num_pages=48, decode_steps=3,
              compilation_cache_dir=os.path.join(tempfile.gettempdir(), "jaxserve-test-xla-cache"))


def _greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)


REGEX = "[a-c]{6}"   # six bytes among three: transformers' greedy over those three is the oracle
# (request id, prompt token ids, params) per wave. Prompt lengths 3 to 40 (prefills of up to 3
# chunks beside decodes); the n=2 request forks its prompt's pages (copy-on-write).
WAVES = [
    [("a", list(range(10, 13)), _greedy(9)),
     ("b", [(7 * i) % 250 for i in range(40)], _greedy(6)),
     ("c", list(range(100, 111)), _greedy(12)),
     ("d", [5, 9, 200, 31, 77, 3, 150, 8, 64, 19, 222, 47, 90, 11, 4, 180, 33, 71, 2, 160, 99, 13],
      _greedy(7, n=2)),
     # constrained: its samplers wait for the step before (a message of their own, replayed too)
     ("g", list(range(30, 44)), dataclasses.replace(_greedy(12), structured_output=StructuredOutput("regex", REGEX)))],
    [("e", [(13 * i + 5) % 256 for i in range(29)], _greedy(8)),
     ("f", list(range(60, 67)), _greedy(10)),
     # penalised: multi-step decodes count its tokens of the step before on the device
     ("h", [3, 3, 8, 8, 120, 44], dataclasses.replace(_greedy(14), repetition_penalty=1.3))],
]


def collect(stream) -> dict:
    """A request's choices: their token ids and each token's top-3 (token id, logprob)."""
    tokens, top = {}, {}
    for out in stream:
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            for r in c.logprobs or []:
                top.setdefault(c.index, []).append(r.top)
    return {"tokens": [tokens[i] for i in sorted(tokens)], "top": [top[i] for i in sorted(top)]}


def main(model_dir: str, coordinator_address: str, process_id: str) -> None:
    dist = DistributedConfig(coordinator_address, num_processes=2, process_id=int(process_id))
    client = factory.build_client(EngineConfig(model=model_dir, mesh={"model": 4}, distributed=dist, **ENGINE))
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
    client.start()
    if not dist.is_leader:
        assert isinstance(client, factory.Follower)
        client.shutdown(drain=True)   # until process 0 stops
        print(json.dumps({"steps": client.steps}))
        return
    assert isinstance(client, EngineThread)
    runner, samplers = client.engine.runner, []
    sample = runner.sample
    runner.sample = lambda launched: (samplers.append(1), sample(launched))[1]   # sent on their own
    multi_steps, launch = [], client.engine._launch
    client.engine._launch = lambda out: (multi_steps.append(out.decode_steps > 1), launch(out))[1]
    results = {}
    for wave in WAVES:
        streams = {rid: client.submit(ids, params, rid) for rid, ids, params in wave}
        results.update({rid: collect(s) for rid, s in streams.items()})
        time.sleep(0.3)   # the engine thread idles: the follower is parked until the next wave
    client.shutdown()
    print(json.dumps({"steps": client.engine.stats["steps"], "samplers": len(samplers), "multi_steps": sum(multi_steps),
                      "pauses": client.engine.runner.broadcaster.pauses, "results": results}))


if __name__ == "__main__":
    main(*sys.argv[1:])
