"""The prompt-logprobs scorer in chunks: any chunk size gives a numpy log-softmax's answer."""
import jax
import numpy as np

from jaxserve import parallel, prompt_logprobs
from jaxserve.checkpoint import param_shapes
from jaxserve.config import ModelConfig
from jaxserve.models import build_model


def test_chunked_scoring_matches_numpy():
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=300, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), param_shapes(cfg))
    model, mesh = build_model(cfg), parallel.make_mesh()
    hidden = rng.standard_normal((16, cfg.hidden_size)).astype(np.float32)
    index = rng.integers(0, 16, 10).astype(np.int32)        # 10 rows: two chunks of 4 and a part
    targets = rng.integers(0, cfg.vocab_size, 10).astype(np.int32)

    logits = hidden[index] @ params["lm_head"]["weight"].T
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = logp[np.arange(10), targets]
    for chunk_rows in (4, 256):
        target, rank, top_ids, top_logprobs = jax.device_get(prompt_logprobs.compute(
            model, params, hidden, index, targets, num_top=5,
            logits_sharding=parallel.logits_sharding(cfg, mesh), chunk_rows=chunk_rows))
        np.testing.assert_allclose(target, want, atol=1e-4)
        np.testing.assert_array_equal(rank, 1 + (logp > want[:, None]).sum(-1))
        np.testing.assert_array_equal(top_ids, np.argsort(-logp, axis=-1)[:, :5])
        np.testing.assert_allclose(top_logprobs, np.sort(logp, axis=-1)[:, ::-1][:, :5], atol=1e-4)
