"""benchmarks/position_extrapolation.py scores what transformers scores: its two model configs
(RoPE Llama, ALiBi MPT) mean the same models to transformers, and its held-out windows' per-token
losses equal transformers' cross entropy on the same windows, past the training context too."""
import numpy as np
import pytest
import torch
import transformers as tf

from benchmarks import position_extrapolation as pe
from jaxserve.checkpoint import load_params
from jaxserve.config import ModelConfig

CONTEXT = 16   # windows of CONTEXT and 4 x CONTEXT tokens are scored


@pytest.mark.parametrize("family", ["RoPE (Llama)", "ALiBi (MPT)"])
def test_heldout_losses_match_transformers(family, tmp_path):
    # transformers' MPT sizes its ALiBi bias by max_seq_len (the `context` given): the longest window
    hf = pe.family_configs(hidden=32, layers=2, heads=4, vocab_size=64, context=4 * CONTEXT)[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**hf), attn_implementation="eager").eval()
    with torch.no_grad():   # spread the weights, so that predictions depend on the context
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    params = load_params(str(tmp_path), cfg)
    stream = np.random.default_rng(0).integers(0, 64, 4 * CONTEXT + 1).astype(np.int32)
    for context in (CONTEXT, 4 * CONTEXT):
        ours = pe.heldout_losses(cfg, params, stream, context, batch_tokens=2 * CONTEXT)
        windows = torch.tensor(stream[:-1].reshape(-1, context), dtype=torch.long)
        targets = torch.tensor(stream[1:].reshape(-1, context), dtype=torch.long)
        with torch.no_grad():
            logits = model(windows).logits
        theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
        np.testing.assert_allclose(ours, theirs.view(-1, context).numpy(), rtol=1e-4, atol=1e-4)
        assert ours.std() > 0.2   # far from uniform predictions (std 0): the comparison can fail
