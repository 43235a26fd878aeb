"""The oracle of the speculative decoding tests' sampling check (tests/test_spec_decode.py,
tests/test_spec_decode_draft.py): seeded draws of three tokens from an engine, against the
target model's own distribution of them, enumerated with transformers."""
import collections

import numpy as np
import torch

from jaxserve import SamplingParams

DRAWS = 400   # the tests reject the distribution at temperature 2 with p ~ 1e-7 at 400 draws
CHOICES = 10


def filtered_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """numpy oracle of the sampler's filters (jaxserve/sampling.py's documented order):
    temperature, top-k, then top-p over the renormalised top-k (a token is kept while the mass
    before it is under top_p); the result renormalised."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    kept = order[:top_k]
    mass_before = np.cumsum(p[kept] / p[kept].sum()) - p[kept] / p[kept].sum()
    # the oracle must not hinge on float error at the top-p boundary
    assert np.abs(mass_before - top_p).min() > 1e-4
    keep[kept[mass_before < top_p]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def exact_triples(hf, prompt: list[int], temperature: float, top_k: int, top_p: float) -> dict:
    """P(t1, t2, t3) of the target alone, enumerated over the filtered supports (transformers, f32)."""
    def dist(prefix):
        return filtered_probs(next_logits(hf, prefix), temperature, top_k, top_p)

    out, p1 = {}, dist(prompt)
    for t1 in np.flatnonzero(p1):
        p2 = dist(prompt + [int(t1)])
        for t2 in np.flatnonzero(p2):
            p3 = dist(prompt + [int(t1), int(t2)])
            for t3 in np.flatnonzero(p3):
                out[(int(t1), int(t2), int(t3))] = p1[t1] * p2[t2] * p3[t3]
    return out


def chi_square_p(counts: dict, exact: dict, draws: int) -> float:
    """Pearson's test of the observed triples against `exact`; cells expecting under 5 pooled."""
    from scipy.stats import chisquare

    assert set(counts) <= set(exact)   # nothing outside the filtered support was ever sampled
    big = sorted(c for c in exact if exact[c] * draws >= 5)
    observed = [counts.get(c, 0) for c in big] + [draws - sum(counts.get(c, 0) for c in big)]
    expected = [exact[c] * draws for c in big] + [draws * (1 - sum(exact[c] for c in big))]
    return chisquare(observed, expected).pvalue


def next_logits(hf, prefix: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([prefix])).logits[0, -1].double().numpy()


def sampled_triples(llm, prompt: list[int], filters: dict):
    """DRAWS seeded draws of 3 tokens after `prompt` at temperature 1: (Counter of the triples,
    draft tokens proposed, accepted). n choices a request (seeds seed..seed+n-1): the prompt is
    prefilled once per request."""
    stats = llm.llm_engine.stats
    before = dict(stats)
    params = [SamplingParams(temperature=1.0, n=CHOICES, seed=i * CHOICES, max_tokens=3, ignore_eos=True, **filters)
              for i in range(DRAWS // CHOICES)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    counts = collections.Counter(tuple(c.token_ids) for o in outs for c in o.outputs)
    return (counts, stats["spec_proposed_tokens"] - before["spec_proposed_tokens"],
            stats["spec_accepted_tokens"] - before["spec_accepted_tokens"])
