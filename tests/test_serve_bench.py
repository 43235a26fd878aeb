"""The serving benchmark client against our real server (subprocess on a free loopback
port): what the client counted and timed agrees with the server's own /metrics."""
import json
import os

import pytest

from benchmarks import serve_bench
from tests.server_harness import BYTES_ENGINE, bytes_model_dir, serving

NUM_PROMPTS = 12
ARGS = ["--num-prompts", str(NUM_PROMPTS), "--request-rate", "20", "--seed", "3", "--prompt-kind", "ids",
        "--vocab-size", "256", "--input-median", "12", "--max-input", "60", "--output-median", "8",
        "--max-output", "40", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--duration-limit", "30",
        "--request-timeout", "120"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory.mktemp("server"), bytes_model_dir(tmp_path_factory), **BYTES_ENGINE)


def test_report_matches_server_metrics(server, tmp_path):
    parser = serve_bench.argparse.ArgumentParser()
    serve_bench.add_arguments(parser)
    out = str(tmp_path / "serve")
    before = server.metrics()
    report = serve_bench.run(parser.parse_args(ARGS + ["--base-url", server.url, "--out", out]))
    after = server.metrics()

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    workload = serve_bench.make_requests(NUM_PROMPTS, 3, "ids", 12, 0.8, 60, 8, 0.8, 40, 256)
    s = report["runs"][0]["summary"]
    assert s["sent"] == s["completed"] == NUM_PROMPTS, s["first_error"]
    assert s["prompt_tokens"] == delta("jaxserve_prompt_tokens_total") == sum(r.input_len for r in workload)
    # ignore_eos: every request runs to max_tokens.
    assert s["output_tokens"] == delta("jaxserve_generation_tokens_total") == sum(r.max_tokens for r in workload)
    finished = sum(delta(k) for k in after if k.startswith("jaxserve_request_success_total"))
    assert finished == delta("jaxserve_time_to_first_token_seconds_count") == NUM_PROMPTS
    # The client times each request from outside the server: never shorter on average.
    server_e2e = delta("jaxserve_e2e_request_latency_seconds_sum") / NUM_PROMPTS * 1e3
    server_ttft = delta("jaxserve_time_to_first_token_seconds_sum") / NUM_PROMPTS * 1e3
    assert s["e2e_ms"]["mean"] >= server_e2e
    assert s["ttft_ms"]["mean"] >= server_ttft
    assert s["e2e_ms"]["p50"] <= s["e2e_ms"]["p90"] <= s["e2e_ms"]["p99"]
    assert s["goodput"] == pytest.approx(s["request_throughput"])     # SLOs of a minute: all met
    # The server's roofline gauges came along, within (0, 1].
    assert 0 < report["runs"][0]["server"]["jaxserve_model_bandwidth_utilization"] <= 1
    for ext in ("json", "md", "png"):
        assert os.path.getsize(f"{out}.{ext}") > 0
    with open(out + ".json") as f:
        assert json.load(f)["runs"][0]["summary"]["completed"] == NUM_PROMPTS


def test_refuses_remote_hosts():
    with pytest.raises(SystemExit, match="not a loopback"):
        serve_bench.check_loopback("http://192.0.2.1:8000", allow_remote=False)
    serve_bench.check_loopback("http://localhost:8000", allow_remote=False)


# ---- roofline accounting (jaxserve/roofline.py): what the /metrics gauges are made of ----
@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    import jax.numpy as jnp

    from jaxserve.checkpoint import load_params
    from jaxserve.config import ModelConfig

    d = bytes_model_dir(tmp_path_factory)
    cfg = ModelConfig.from_pretrained(d)
    return d, cfg, load_params(d, cfg, jnp.float32)


def test_attended_pairs_match_a_mask():
    import numpy as np

    from jaxserve.roofline import _attended

    for kv in range(1, 40, 3):
        for n in range(1, kv + 1, 2):
            for window in (None, 1, 4, 16, 64):
                q = np.arange(kv - n, kv)[:, None]          # 0-based positions of the new queries
                k = np.arange(kv)[None, :]
                mask = (k <= q) & ((k > q - window) if window else True)
                assert _attended(n, kv, window) == mask.sum(), (n, kv, window)


def test_cost_model_matches_params_and_xla(small_model):
    import jax
    import jax.numpy as jnp

    from jaxserve.models import build_model
    from jaxserve.roofline import CostModel

    _, cfg, params = small_model
    cost = CostModel(cfg, 4)
    # Every weight is read once, except the untied embedding table (only its rows are gathered).
    table = params["model"]["embed_tokens"]["embedding"].nbytes
    assert cost.weight_bytes == sum(x.nbytes for x in jax.tree.leaves(params)) - table
    # One token: XLA's own FLOP count of the forward (elementwise work is the small remainder).
    model = build_model(cfg, jnp.float32)
    forward = jax.jit(lambda p, t, q: model.apply({"params": p}, t, q, method=model.forward_logits))
    analysis = forward.lower(params, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)).compile().cost_analysis()
    xla_flops = (analysis[0] if isinstance(analysis, list) else analysis)["flops"]
    assert cost.step([(1, 1, True)]).flops == pytest.approx(xla_flops, rel=0.03)


def test_meter_reads_each_step_schedule(small_model):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import LLMEngine
    from jaxserve.roofline import Peaks, RooflineMeter
    from jaxserve.sampling_params import SamplingParams

    d, cfg, params = small_model
    engine = LLMEngine(EngineConfig(model=d, max_num_seqs=2, max_num_batched_tokens=16, prefill_chunk_size=8,
                                    max_prefill_seqs=1, max_model_len=64, num_pages=16), params=params)
    meter = RooflineMeter(engine, Peaks(flops=1e9, bandwidth=1e9, source="test"))
    engine.add_request(list(range(3, 15)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        meter.on_step([], 0.5)
    # 12 prompt tokens in chunks of 8 + 4 (the second samples), then two decodes.
    expected = [meter.cost.step(rows) for rows in ([(8, 8, False)], [(4, 12, True)], [(1, 13, True)], [(1, 14, True)])]
    assert [c for c, _ in meter._steps] == expected
    mbu, mfu = meter.utilization()
    assert mbu == pytest.approx(sum(c.bytes for c in expected) / 2.0 / 1e9)
    assert mfu == pytest.approx(sum(c.flops for c in expected) / 2.0 / 1e9)
