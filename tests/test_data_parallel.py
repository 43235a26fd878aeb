"""Data-parallel routing (jaxserve/data_parallel.py), on two replicas of the embedded model on this
one device: a prompt that goes on from one a replica served goes to that replica and finds its
start cached there, though the other replica is idle; a replica more than max_num_seqs requests
busier than the least loaded gets none; without a hit, requests go to the least loaded."""
import time

import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.data_parallel import DataParallelEngine
from jaxserve.engine import LLMEngine
from jaxserve.engine_thread import EngineThread
from jaxserve.sampling_params import SamplingParams
from tests.server_harness import store_of

ENGINE = dict(max_num_seqs=2, max_model_len=128, num_pages=48, page_size=8)
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)   # busy long after its submit returns


def test_requests_go_where_their_prefix_is_cached():
    engines = [LLMEngine(EngineConfig(model=None, **ENGINE, compilation_cache_dir=store_of(ENGINE))) for _ in range(2)]
    client = DataParallelEngine([EngineThread(e) for e in engines]).start(warmup=False)
    rng = np.random.default_rng(0)
    pending = lambda: [t.num_pending for t in client.threads]   # noqa: E731

    def settle(expected: list[int]) -> None:
        """Wait for the finished requests' counts to drop (just after their last output)."""
        deadline = time.monotonic() + 10
        while pending() != expected and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending() == expected
    try:
        first = rng.integers(3, 256, 37).tolist()
        out = list(client.submit(first, SHORT))                  # both idle: replica 0
        settle([0, 0])
        turn = first + [t for o in out for c in o.outputs for t in c.token_ids] + [7, 8, 9]
        running = [client.submit(rng.integers(3, 256, 20).tolist(), LONG)]   # no hit, a tie: replica 0
        assert pending() == [1, 0]
        again = list(client.submit(turn, SHORT))                 # cached on replica 0, 1 request busier
        assert again[-1].num_cached_tokens == len(first) + 3     # all first computed: 4 pages and 8 tokens
        assert engines[1].stats["requests_finished"] == 0
        settle([1, 0])
        running += [client.submit(turn + [i], LONG) for i in range(2)]   # cached on 0: there
        assert pending() == [3, 0]
        running.append(client.submit(turn + [5], LONG))          # replica 0 is 3 > max_num_seqs busier
        assert pending() == [3, 1]
        outs = [list(s) for s in running]
        assert outs[-1][-1].num_cached_tokens == 0 and engines[1].stats["requests_finished"] == 1
    finally:
        client.shutdown()
