"""Multi-host: the step broadcast (in process), and two local processes serving one TP-4 engine
through jax.distributed on the CPU (gloo) collectives, against transformers' greedy tokens; both
built by jaxserve.factory (process 0 an EngineThread, process 1 a Follower); and the launcher's
reading of the JAXSERVE_* variables."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import torch

from jaxserve import multihost
from jaxserve.config import DistributedConfig
from jaxserve.tokenizer import load_tokenizer
from tests.conftest import fake_devices_env
from tests.hf_models import save_engine_model
from tests.multihost_worker import WAVES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_broadcast_round_trip_in_one_process():
    big = np.arange(3 * multihost.BLOCK_SIZE + 5, dtype=np.int32)   # first block + 4 more
    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([0.5, -1e-3], np.float32),
              np.array([True, False, True]), np.uint32(7) * np.ones((), np.uint32),
              np.zeros((0, 4), np.int32), big.view(np.float32)]
    out = multihost.broadcast_arrays(arrays)
    assert len(out) == len(arrays)
    for a, b in zip(arrays, out):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    assert multihost.broadcast_arrays([]) == []
    with pytest.raises(TypeError, match="float64"):
        multihost.broadcast_arrays([np.zeros(2)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(model_dir: str) -> list[dict]:
    port = free_port()
    procs = []
    for pid in range(2):
        env = fake_devices_env(2)
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", model_dir,
                                       f"127.0.0.1:{port}", str(pid)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr[-4000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
    return outs


def hf_greedy(hf, ids: list[int], n: int, allowed: list[int] | None = None,
              repetition_penalty: float = 1.0) -> tuple[list[int], list[list[tuple[int, float]]]]:
    """n greedy tokens after `ids` in transformers (the most likely of `allowed` where given; with
    a repetition penalty on every token seen, as HF's logits processor), with each step's top-3
    (id, logprob) of the model's distribution."""
    ids, out, tops = list(ids), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
            logp = torch.log_softmax(logits, -1)
            top = torch.topk(logp, 3)
            tops.append(list(zip(top.indices.tolist(), top.values.tolist())))
            seen = torch.tensor(sorted(set(ids)))
            logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition_penalty,
                                       logits[seen] * repetition_penalty)
            ids.append(int(logits.argmax()) if allowed is None else max(allowed, key=lambda t: logp[t]))
            out.append(ids[-1])
    return out, tops


def test_engine_on_two_processes_matches_one_process(tmp_path):
    hf = save_engine_model(str(tmp_path))
    leader, follower = run_workers(str(tmp_path))
    assert leader["samplers"] > 0   # the constrained request's steps overlapped
    assert leader["multi_steps"] > 0   # decode_steps 3 while both seats decoded plainly
    assert leader["steps"] + leader["samplers"] == follower["steps"] > 0   # the follower replayed every message
    assert leader["pauses"] >= len(WAVES) - 1         # parked between waves, then woken
    requests = [r for wave in WAVES for r in wave]
    assert sorted(leader["results"]) == sorted(rid for rid, _, _ in requests)
    abc = [load_tokenizer(str(tmp_path)).encode(c, add_special_tokens=False)[0] for c in "abc"]
    for rid, ids, params in requests:
        if params.structured_output is not None:   # REGEX: six of "abc", then the grammar is complete
            want_tokens, want_top = hf_greedy(hf, ids, 6, allowed=abc)
        else:
            want_tokens, want_top = hf_greedy(hf, ids, params.max_tokens, repetition_penalty=params.repetition_penalty)
        got = leader["results"][rid]
        assert got["tokens"] == [want_tokens] * params.n, rid
        for top in got["top"]:
            for got_step, want_step in zip(top, want_top, strict=True):
                assert [t for t, _ in got_step] == [t for t, _ in want_step], rid
                np.testing.assert_allclose([p for _, p in got_step], [p for _, p in want_step], atol=1e-4)


def test_distributed_config_from_flags_then_variables(monkeypatch):
    for name in DistributedConfig.ENV.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAXSERVE_COORDINATOR_ADDRESS", "node0:1234")
    monkeypatch.setenv("JAXSERVE_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAXSERVE_PROCESS_ID", "3")
    assert multihost.distributed_config() == DistributedConfig("node0:1234", 4, 3)
    assert multihost.distributed_config(process_id=1) == DistributedConfig("node0:1234", 4, 1)   # flags first
    assert multihost.distributed_config(num_processes=1, process_id=0) is None   # one process
    with pytest.raises(ValueError, match="process_id must be in"):
        multihost.distributed_config(process_id=4)
