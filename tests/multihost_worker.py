"""One of two local processes serving one TP-4 model through jax.distributed (2 CPU devices
each), run by tests/test_multihost.py:
  JAXSERVE_COORDINATOR_ADDRESS=127.0.0.1:PORT JAXSERVE_NUM_PROCESSES=2 JAXSERVE_PROCESS_ID=i \\
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.multihost_worker CKPT_DIR
Process 0 plays the engine: it decides every step (prefill, then greedy decodes) and
broadcasts the step's arrays; process 1 only follows. Process 0 prints a JSON line with the
tokens and logits next to a single-device greedy_generate of the same checkpoint."""
import json
import sys

import jax
import numpy as np

from jaxserve import checkpoint, multihost, parallel
from jaxserve.config import ModelConfig
from jaxserve.generate import greedy_generate
from jaxserve.models import build_model
from tests.parallel_checks import (CONFIGS, NEW_TOKENS, decode_args, empty_cache, make_step,
                                   page_rows, prompts, step_args)


def main(ckpt_dir: str) -> None:
    multihost.initialize()
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.devices())
    cfg = ModelConfig.from_hf_dict(CONFIGS["even"])
    mesh = parallel.make_mesh({"model": 4})
    shardings = parallel.param_shardings(checkpoint.param_shapes(cfg), mesh, cfg)
    params = checkpoint.load_params(ckpt_dir, cfg, shardings=shardings)  # own slices only
    step = make_step(build_model(cfg), mesh, cfg)
    state = {"kv": empty_cache(cfg, mesh), "steps": 0}

    def run(arrays):
        logits, state["kv"] = step(params, state["kv"], *arrays)
        state["steps"] += 1
        return np.asarray(logits.addressable_data(0))  # replicated: every process has it all

    if not multihost.is_leader():
        multihost.follow(run)
        print(json.dumps({"process": 1, "steps": state["steps"]}))
        return
    ps = prompts()
    lens = np.array([len(p) for p in ps])
    arrays, tokens, logits = step_args(ps, [0, 0], page_rows()), [], []
    for i in range(NEW_TOKENS):
        logits.append(run(multihost.broadcast_arrays(list(arrays))))
        tokens.append(logits[-1].argmax(-1))
        lens = lens + 1
        arrays = decode_args(tokens[-1], lens)
    multihost.broadcast_arrays([])
    ref_tokens, ref_logits = greedy_generate(cfg, checkpoint.load_params(ckpt_dir, cfg), ps,
                                             NEW_TOKENS, return_logits=True)
    print(json.dumps({"process": 0, "steps": state["steps"],
                      "tokens": np.stack(tokens, 1).tolist(), "ref_tokens": ref_tokens,
                      "max_logit_diff": float(np.abs(np.stack(logits, 1) - ref_logits).max())}))


if __name__ == "__main__":
    main(sys.argv[1])
