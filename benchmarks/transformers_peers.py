"""The transformers systems the offline benchmark sets jaxserve against, on the same weights
(float32, torch on the CPU), greedy, every request forced to its max_tokens:
  - static `generate` in left-padded batches, each run to its longest request;
  - transformers' own continuous batching (`continuous_batching_context_manager`, requests through
    `add_request(ids, max_new_tokens=n)`), its paged KV cache read by SDPA. transformers 5.23 takes
    this as attn_implementation "sdpa": it strips the older spelling "paged|sdpa" to that, with a
    deprecation warning.
"""
from __future__ import annotations

import time

from benchmarks.common import Request, Run, check_lengths


def run_generate(model, requests: list[Request], batch_size: int, pad_id: int) -> Run:
    """transformers generate in left-padded batches of `batch_size`, each run to its longest
    request's output length. HF's ignore_eos: an eos id outside the vocabulary never stops a row
    (min_new_tokens would instead mask eos and change greedy outputs where eos is the argmax)."""
    import torch

    outputs = []
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start:start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                 max_new_tokens=n, do_sample=False,
                                 pad_token_id=pad_id, eos_token_id=model.config.vocab_size)
        outputs += [out[j, width:width + r.max_tokens].tolist() for j, r in enumerate(batch)]
    seconds = time.perf_counter() - t0   # .tolist() above waited for the device
    check_lengths(outputs, requests)
    return Run(f"HF generate B={batch_size}", len(requests), sum(map(len, outputs)), seconds, outputs)


class ContinuousPeer:
    """transformers' continuous batching on `model`, with jaxserve's budgets: at most max_num_seqs
    requests and max_batch_tokens tokens a step, and enough pages that nothing is preempted. Pages
    keep transformers' default size (256 tokens). Prefix sharing is off, as in jaxserve's runs.
    One manager serves every run: it is warmed up once, untimed, and kept between runs."""

    def __init__(self, model, max_num_seqs: int, max_batch_tokens: int, max_model_len: int):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        model.set_attn_implementation("sdpa")
        self.model = model
        # eos -1: no token stops a request, each runs to its max_new_tokens.
        self.generation_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0)
        page_size = ContinuousBatchingConfig.page_size
        self.cb_config = ContinuousBatchingConfig(
            num_blocks=max_num_seqs * -(-max_model_len // page_size), max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_num_seqs, allow_block_sharing=False, auto_switch_to_flash=False)

    def run(self, requests: list[Request]) -> Run:
        """All requests submitted at once; timed from the first submission to the last result."""
        with self.model.continuous_batching_context_manager(
                generation_config=self.generation_config, continuous_batching_config=self.cb_config,
                persistent_manager=True) as manager:
            t0 = time.perf_counter()
            ids = [manager.add_request(r.prompt_token_ids, request_id=str(i), max_new_tokens=r.max_tokens)
                   for i, r in enumerate(requests)]
            done = {}
            while len(done) < len(ids):
                result = manager.get_result(timeout=1)
                if result is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching loop stopped")
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(f"request {result.request_id}: {result.error}")
                    done[result.request_id] = result.generated_tokens
            seconds = time.perf_counter() - t0
        outputs = [done[i] for i in ids]
        check_lengths(outputs, requests)
        return Run("HF continuous batching", len(requests), sum(map(len, outputs)), seconds, outputs)

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
