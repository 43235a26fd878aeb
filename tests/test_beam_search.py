"""Beam search (jaxserve/beam_search.py, LLM.beam_search) against transformers'
generate(num_beams=k, early_stopping="never"): every returned beam's tokens and score, in order,
on a seeded byte-level model, with eos ignored and with an eos the beams reach (<s>, which this
model writes often), under several length penalties."""
import numpy as np
import pytest
import torch

from jaxserve import LLM, BeamSearchParams
from jaxserve.beam_search import search
from jaxserve.sampling_params import InvalidRequest
from tests.hf_models import save_engine_model
from tests.server_harness import TEST_ENGINE

PROMPTS = [[256, 72, 101, 108, 108, 111], [256] + np.random.default_rng(0).integers(0, 256, 37).tolist()]
WIDTH, NEW_TOKENS = 4, 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(transformers model, LLM) of a seeded model whose eos ids are </s> and <s>."""
    path = str(tmp_path_factory.mktemp("beam-model"))
    hf = save_engine_model(path, eos_token_id=[256, 257])
    return hf, LLM(model=path, **TEST_ENGINE, compilation_cache_dir=None)


def hf_beams(hf, prompt: list[int], eos: list[int] | None, length_penalty: float, max_new_tokens: int = NEW_TOKENS,
             width: int = WIDTH):
    """transformers' `width` best (generated tokens, score), best first (a finished beam's pad cut)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                      max_new_tokens=max_new_tokens, early_stopping="never", do_sample=False,
                      length_penalty=length_penalty, eos_token_id=eos, pad_token_id=-1,
                      output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        beams.append(([t for t in seq if t != -1], score))
    return beams


@pytest.mark.parametrize("ignore_eos,length_penalty", [(True, 1.0), (False, 1.0), (False, 0.0), (False, 2.0)])
def test_beams_are_transformers_beams(models, ignore_eos, length_penalty):
    hf, llm = models
    params = BeamSearchParams(WIDTH, NEW_TOKENS, ignore_eos=ignore_eos, length_penalty=length_penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    stopped = 0
    for prompt, out in zip(PROMPTS, outputs):
        want = hf_beams(hf, prompt, None if ignore_eos else [256, 257], length_penalty)
        got = [(b.tokens[len(prompt):], b.score) for b in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in want], prompt
        np.testing.assert_allclose([s for _, s in got], [s for _, s in want], rtol=1e-4)
        for b in out.sequences:
            ends = b.tokens[-1] in (256, 257) and not ignore_eos
            assert b.finish_reason == ("stop" if ends else "length")
            assert b.cum_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(b.tokens[len(prompt):], b.logprobs)))
            assert b.text == llm.get_tokenizer().decode(b.tokens)
            stopped += ends
    assert stopped or ignore_eos or length_penalty > 0   # with no reward for length, beams that stop win


def test_context_end_and_refusals(models):
    """A prompt near max_model_len gets the tokens left (transformers' beams at that length);
    one that fills it, and a beam width past what the logprobs give, are refused."""
    hf, llm = models
    prompt = PROMPTS[1] * 3 + PROMPTS[1][:128 - 3 * len(PROMPTS[1]) - 3]   # 3 tokens left
    (out,) = llm.beam_search([prompt], BeamSearchParams(WIDTH, NEW_TOKENS, ignore_eos=True))
    assert [b.tokens[len(prompt):] for b in out.sequences] == [t for t, _ in hf_beams(hf, prompt, None, 1.0, 3)]
    with pytest.raises(InvalidRequest, match="leaves no room"):
        llm.beam_search([prompt + [1, 2, 3]], BeamSearchParams(WIDTH, NEW_TOKENS))
    with pytest.raises(InvalidRequest, match="beam_width must be between 1 and 10"):
        BeamSearchParams(11, NEW_TOKENS)


def test_a_live_beam_that_can_still_win_is_searched_on():
    """One beam, length penalty 1, 4 tokens: eos first scores -0.5 / 1; the other beam's -1.2 over
    its 2 tokens would be -0.6, but over 4 tokens of near-certain continuations it ends at
    -1.23 / 4 and wins: the search stops early only when no live beam can win at any length."""
    EOS, A, B = 9, 1, 2

    def next_tokens(batch):
        return [[(EOS, -0.5), (A, -1.2)] if len(seq) == 1 else [(B, -0.01), (EOS, -5.0)] for seq in batch]
    (best,) = search([[7]], BeamSearchParams(1, 4, length_penalty=1.0), {EOS}, 100, next_tokens)[0]
    assert (best.tokens, best.finish_reason) == ([7, A, B, B, B], "length")
    assert best.score == pytest.approx(-1.23 / 4)
