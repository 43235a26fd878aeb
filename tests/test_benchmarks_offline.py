"""Offline throughput benchmark, smoke run on a small random Llama: every schedule of the engine
produces transformers' greedy tokens, the token counts are the requested ones, and the KV figures
obey paging (only each sequence's last page is partly empty)."""
from benchmarks import offline_throughput
from tests.hf_models import save_engine_model

ARGS = ["--num-prompts", "6", "--min-input", "8", "--max-input", "40", "--min-output", "4", "--max-output", "12",
        "--hf-batch-sizes", "2,4", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
        "--prefill-chunk-size", "16", "--repeats", "1"]


def test_offline_benchmark_smoke(tmp_path):
    model_dir = str(tmp_path / "model")
    save_engine_model(model_dir)
    out = tmp_path / "offline.md"
    [r] = offline_throughput.main(["--models", model_dir, "--out", str(out)] + ARGS)

    requested = sum(q.max_tokens for q in r["requests"])
    hf_runs = r["hf_runs"]
    for run in r["runs"] + hf_runs:
        assert run.output_tokens == requested and run.seconds > 0
    assert [run.system for run in r["runs"]] == ["jaxserve continuous", "jaxserve static, groups of 2",
                                                 "jaxserve static, groups of 4", "jaxserve admission_eagerness=0.0"]
    for run in r["runs"] + hf_runs[1:]:
        assert run.outputs == hf_runs[0].outputs, run.system
    assert r["same_outputs"] == r["hf_requests"] == 6

    kv, page = r["kv"], r["ecfg"].page_size
    assert 0 < kv.running <= 4
    assert kv.pages * page - kv.running * page < kv.live_tokens <= kv.pages * page
    assert kv.contiguous_share < kv.paged_share <= 1

    text = out.read_text()
    for row in ("| jaxserve continuous | 6 |", "| HF generate B=2 | 6 |", "| jaxserve static, groups of 4 |"):
        assert row in text
