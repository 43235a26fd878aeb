"""Multi-host: the step broadcast (in process), and two local processes serving one TP-4
model through jax.distributed on the CPU (gloo) collectives."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxserve import checkpoint, multihost
from tests.parallel_checks import CONFIGS, NEW_TOKENS, model_and_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_broadcast_round_trip_in_one_process():
    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([0.5, -1e-3], np.float32),
              np.array([True, False, True]), np.uint32(7) * np.ones((), np.uint32),
              np.zeros((0, 4), np.int32)]
    out = multihost.broadcast_arrays(arrays)
    assert len(out) == len(arrays)
    for a, b in zip(arrays, out):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert multihost.broadcast_arrays([]) == []
    with pytest.raises(TypeError, match="float64"):
        multihost.broadcast_arrays([np.zeros(2)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device(tmp_path):
    _, params = model_and_params("even")
    checkpoint.save_pretrained(params, CONFIGS["even"], str(tmp_path))
    port = free_port()
    procs = []
    for pid in range(2):
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
               "JAXSERVE_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAXSERVE_NUM_PROCESSES": "2", "JAXSERVE_PROCESS_ID": str(pid)}
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.multihost_worker", str(tmp_path)],
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
    leader, follower = outs
    assert leader["steps"] == follower["steps"] == NEW_TOKENS  # the follower ran every step
    assert leader["tokens"] == leader["ref_tokens"]
    assert leader["max_logit_diff"] < 1e-4
