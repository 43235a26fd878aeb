"""Offline throughput benchmark, smoke run on a small random Llama: every schedule of the engine
and transformers' continuous batching produce transformers' static greedy tokens, the token counts are the requested ones, and the KV figures
obey paging (only each sequence's last page is partly empty)."""
from benchmarks import offline_throughput
from jaxserve.config import ModelConfig
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
    assert [run.system for run in hf_runs] == ["HF generate B=2", "HF generate B=4", "HF continuous batching"]
    for run in r["runs"] + hf_runs[1:]:
        assert run.outputs == hf_runs[0].outputs, run.system
    assert r["same_outputs"] == {run.system: 6 for run in hf_runs} and r["hf_requests"] == 6
    assert r["flops"] == workload_flops(ModelConfig.from_pretrained(model_dir), r["requests"])
    assert r["matmul_flops"] > 0

    kv, page = r["kv"], r["ecfg"].page_size
    assert 0 < kv.running <= 4
    assert kv.pages * page - kv.running * page < kv.live_tokens <= kv.pages * page
    assert kv.contiguous_share < kv.paged_share <= 1

    text = out.read_text()
    for row in ("| jaxserve continuous | 6 |", "| HF generate B=2 | 6 |", "| HF continuous batching | 6 |",
                "| jaxserve static, groups of 4 |"):
        assert row in text


def workload_flops(c: ModelConfig, requests) -> int:
    """Closed form over the whole workload: every position but a request's last output token passes
    through the layers once, each output token is sampled through the LM head, and a position
    attends to itself and every earlier one (no sliding windows in this model)."""
    passes = [len(q.prompt_token_ids) + q.max_tokens - 1 for q in requests]
    layer = c.hidden_size * c.head_dim * 2 * (c.num_heads + c.num_kv_heads) + 3 * c.hidden_size * c.intermediate_size
    norms = c.num_layers * 2 * c.hidden_size + c.hidden_size   # 2 FLOPs per weight, as the cost model counts them
    return (2 * sum(passes) * (c.num_layers * layer + norms)
            + 2 * sum(q.max_tokens for q in requests) * c.vocab_size * c.hidden_size
            + 4 * c.num_heads * c.head_dim * c.num_layers * sum(t * (t + 1) // 2 for t in passes))
