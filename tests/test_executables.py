"""The executable store (jaxserve/executables.py): a second engine with the same config loads
warm-up's executables instead of compiling them and generates exactly what the compiling engine
did; a changed model config, a damaged entry or changed sources compile instead."""
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxserve import executables
from jaxserve.compilations import CompileCounter
from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.sampling_params import SamplingParams
from tests.hf_models import save_engine_model

# Few buckets: 3 step shapes (decode 1 and 2 rows, one prefill), their samplers and the rest.
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=16, max_prefill_seqs=1,
             max_model_len=64, num_pages=24, page_size=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("executables_model"))
    save_engine_model(d)
    return d


def _warm_engine(model_dir, cache_dir, **host_settings):
    jax.clear_caches()   # nothing compiled by an engine before: a compilation here is counted
    engine = LLMEngine(EngineConfig(model=model_dir, compilation_cache_dir=str(cache_dir), **SMALL, **host_settings))
    before = CompileCounter.count
    engine.warmup()
    return engine, CompileCounter.count - before


def _generate(engine):
    """Greedy, seeded sampling with logprobs, and penalties with a bias: the sampler's variants."""
    rng = np.random.default_rng(0)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=12, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, logit_bias={5: 3.0}, seed=3, max_tokens=12,
                             ignore_eos=True)]
    ids = [engine.add_request(rng.integers(0, 256, n).tolist(), p) for n, p in zip((5, 30, 9), params)]
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            for c in o.outputs:
                out[o.request_id] += list(zip(c.token_ids, c.logprobs or [None] * len(c.token_ids)))
    return [out[i] for i in ids]


def test_second_engine_loads_instead_of_compiling(model_dir, tmp_path):
    first, first_compiles = _warm_engine(model_dir, tmp_path)
    built = len(first.runner.executables.table)
    assert first.runner.executables.compiled == built > 10 and first.runner.executables.loaded == 0
    assert first_compiles >= built
    expected = _generate(first)

    # The same model at another path, with other settings that only the host reads: the same store.
    copy = str(tmp_path / "model_copy")
    shutil.copytree(model_dir, copy)
    second, second_compiles = _warm_engine(copy, tmp_path, seed=5, max_queue_size=3, max_failed_steps=9,
                                           request_timeout_s=30.0)
    assert second.runner.executables.loaded == built and second.runner.executables.compiled == 0
    assert second_compiles == 0
    before = CompileCounter.count
    assert _generate(second) == expected
    assert CompileCounter.count == before   # serving ran the loaded executables, nothing else

    # One damaged entry: compiled again (and rewritten), the others loaded; serving is unchanged.
    entry = sorted(os.listdir(second.runner.executables.directory))[0]
    with open(os.path.join(second.runner.executables.directory, entry), "wb") as f:
        f.write(b"not an executable")
    third, _ = _warm_engine(model_dir, tmp_path)
    assert (third.runner.executables.loaded, third.runner.executables.compiled) == (built - 1, 1)
    assert _generate(third) == expected

    # A changed model config misses the store. Here rather than in a test of its own: the store
    # already holds this model's executables, which a test of its own compiled once more to fill
    # one. Same shapes, another program: the norms' epsilon, edited at the copy's path.
    with open(os.path.join(copy, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(copy, "config.json"), "w") as f:
        json.dump(dict(config, rms_norm_eps=config["rms_norm_eps"] * 10), f)
    changed, changed_compiles = _warm_engine(copy, tmp_path)
    assert changed.runner.executables.loaded == 0
    assert changed.runner.executables.compiled == len(changed.runner.executables.table) > 10
    assert changed_compiles >= changed.runner.executables.compiled


def test_context_covers_sources_and_engine_config(model_dir, monkeypatch):
    devices = jax.devices()[:1]
    ecfg = EngineConfig(model=model_dir, **SMALL)
    digest = executables.context_digest(devices, ecfg)
    assert executables.context_digest(devices, ecfg) == digest
    assert executables.context_digest(devices, dataclasses.replace(ecfg, max_num_seqs=4)) != digest
    programs = ecfg.program_settings()
    assert "max_num_seqs" in programs and "kv_cache_dtype" in programs and "quantization" in programs
    assert not set(EngineConfig.HOST_ONLY) & set(programs)
    monkeypatch.setattr(executables, "source_digest", lambda: "a changed jaxserve source")
    assert executables.context_digest(devices, ecfg) != digest
