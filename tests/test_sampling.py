"""On-device sampling against numpy references of the HF/vLLM semantics."""
import dataclasses
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxserve.sampling import (SamplingMetadata, _top_k_top_p_threshold, apply_penalties, metadata_for, sample,
                               uses_filters)
from jaxserve.sampling_params import SamplingParams as P


def build(params, seeds=None, prompts=None, outputs=None, pad_to=None, history_len=None):
    n = len(params)
    return SamplingMetadata.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        seeds if seeds is not None else list(range(n)), pad_to or n, history_len)


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    x = x.astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


def ref_allowed(logits, temperature, top_k, top_p, min_p):
    """HF warpers in order: TopK (ties kept), TopP (ascending cumsum <= 1 - p removed), MinP."""
    x = logits.astype(np.float64) / temperature
    allowed = np.ones(x.shape, bool)
    if 0 < top_k < len(x):
        allowed &= x >= np.sort(x)[-top_k]
    if top_p < 1.0:
        z = np.where(allowed, x, -np.inf)
        order = np.argsort(z)
        remove = np.cumsum(softmax(z[order])) <= 1 - top_p
        remove[-1] = False
        allowed[order[remove]] = False
    if min_p > 0.0:
        p = softmax(np.where(allowed, x, -np.inf))
        allowed &= p >= min_p * p.max()
    return allowed


def ref_penalties(logits, prompt, output, p):
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


def test_greedy_and_top_k_1_equal_argmax():
    logits = np.random.default_rng(0).normal(size=(6, 300)).astype(np.float32)
    expected = logits.argmax(-1)
    all_greedy = build([P(temperature=0.0)] * 3 + [P(temperature=1.3, top_k=1)] * 3)
    np.testing.assert_array_equal(sample(logits, all_greedy).tokens, expected)
    mixed = build([P(temperature=0.0), P(temperature=1.0), P(top_k=1), P(top_p=0.5), P(temperature=0.0), P(top_k=1)],
                  pad_to=8)
    tokens = np.asarray(sample(np.pad(logits, ((0, 2), (0, 0))), mixed).tokens)
    np.testing.assert_array_equal(tokens[[0, 2, 4, 5]], expected[[0, 2, 4, 5]])


def test_builder_pads_with_greedy_rows_and_sends_history_only_for_penalties():
    md = build([P(temperature=0.5, top_k=5)], seeds=[-1], outputs=[[4, 5]], pad_to=4)
    np.testing.assert_array_equal(md.temperature, [0.5, 0, 0, 0])
    assert md.seed[0] == 2**32 - 1 and md.step[0] == 2 and md.history.shape == (4, 0)
    md = build([P(), P(presence_penalty=0.5)], prompts=[[1] * 40, [1] * 20], outputs=[[], [2] * 5])
    assert md.history.shape == (2, 32) and md.prompt_len.tolist() == [0, 20]
    assert build([P(presence_penalty=0.5)], history_len=100, prompts=[[1] * 5]).history.shape == (1, 100)
    with pytest.raises(ValueError):
        build([P(repetition_penalty=1.1)], history_len=4, prompts=[[1] * 5])


def test_penalties_match_reference():
    rng = np.random.default_rng(1)
    vocab = 50
    params = [P(repetition_penalty=1.3), P(repetition_penalty=0.7, presence_penalty=0.5),
              P(frequency_penalty=0.4), P(presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=1.1),
              P()]
    prompts = [rng.integers(0, vocab, size=int(rng.integers(1, 20))).tolist() for _ in params]
    outputs = [rng.integers(0, 10, size=int(rng.integers(0, 15))).tolist() for _ in params]  # repeats
    logits = rng.normal(size=(6, vocab)).astype(np.float32) * 3
    for history_len in (None, 64):
        md = build(params, prompts=prompts, outputs=outputs, pad_to=6, history_len=history_len)
        got = np.asarray(apply_penalties(logits, md))
        for i, p in enumerate(params):
            np.testing.assert_allclose(got[i], ref_penalties(logits[i], prompts[i], outputs[i], p), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got[5], logits[5])  # padding row untouched
    # Through `sample`: greedy rows pick the argmax of the penalised logits; logprobs stay raw.
    greedy = [P(temperature=0.0, repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty, logprobs=0) for p in params]
    out = sample(logits, build(greedy, prompts=prompts, outputs=outputs, pad_to=6), num_logprobs=3)
    expected = [ref_penalties(logits[i], prompts[i], outputs[i], p).argmax() for i, p in enumerate(params)]
    np.testing.assert_array_equal(np.asarray(out.tokens)[:5], expected)
    np.testing.assert_allclose(out.logprobs, log_softmax(logits)[np.arange(6), out.tokens], atol=1e-5)


def test_logprobs_are_raw_log_softmax():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 1000)).astype(np.float32) * 4
    params = [P(temperature=0.5, top_p=0.8), P(temperature=0.0), P(temperature=1.7, frequency_penalty=1.0)]
    md = build(params, outputs=[[], [], [1, 2, 3]], pad_to=4)
    unasked = sample(logits, md, num_logprobs=5)   # no row asked: no softmax, zeros
    assert not np.any(unasked.logprobs) and not np.any(unasked.top_ids) and not np.any(unasked.top_logprobs)
    md = build([dataclasses.replace(params[0], logprobs=5)] + params[1:], outputs=[[], [], [1, 2, 3]], pad_to=4)
    out = sample(logits, md, num_logprobs=5)   # one row asked: every row gets them
    np.testing.assert_array_equal(out.tokens, unasked.tokens)
    ref = log_softmax(logits)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(4), out.tokens], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-ref, axis=-1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, axis=-1)[:, ::-1][:, :5], atol=1e-5)
    assert out.top_ids.shape == (4, 5) and sample(logits, md).top_ids.shape == (4, 0)


FILTERS = [  # temperature, top_k, top_p, min_p
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.3, 0, 1.0, 0.08),
    (0.8, 12, 0.85, 0.03),
    (1.0, 100, 1.0, 0.0),  # top_k above the vocabulary = off
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTERS)
def test_filters_sample_exactly_the_allowed_set_with_reference_probabilities(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(3)
    vocab, rows, steps = 64, 512, 4
    row = rng.normal(size=vocab).astype(np.float32)
    allowed = ref_allowed(row, temperature, top_k, top_p, min_p)
    probs = softmax(np.where(allowed, row.astype(np.float64) / temperature, -np.inf))
    md = build([P(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)] * rows, seeds=list(range(rows)))
    logits = np.broadcast_to(row, (rows, vocab))
    tokens = np.concatenate([np.asarray(sample(logits, md.replace(step=md.step + s)).tokens) for s in range(steps)])
    assert allowed[tokens].all(), sorted(set(tokens[~allowed[tokens]]))
    counts = np.bincount(tokens, minlength=vocab)
    assert (counts[probs > 0.02] > 0).all()  # every likely allowed token shows up
    big = probs * len(tokens) >= 5  # chi-square cells: the likely tokens, the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(probs[big], probs[~big].sum()) * len(tokens)
    keep = expected > 0
    assert stats.chisquare(observed[keep], expected[keep]).pvalue > 1e-3


def threshold_oracle(x, k, p):
    """float64: the k-th largest value (ties kept), then the largest value v whose mass of values
    >= v, renormalised over the top k, reaches p; and whether a mass within 1e-5 of p made
    that choice (float32 sums may choose either side)."""
    values = np.unique(x)[::-1]
    kth = np.sort(x)[::-1][min(k, len(x)) - 1] if k > 0 else values[-1]
    kept = x[x >= kth].astype(np.float64)
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    if p >= 1.0:
        return kth, False
    for v in values[values >= kth]:
        mass = probs[kept >= v].sum()
        if mass >= p:
            return v, abs(mass - p) < 1e-5 or abs(probs[kept > v].sum() - p) < 1e-5


def test_top_k_top_p_threshold_matches_the_float64_oracle():
    """The radix select's threshold over rows with ties at every boundary (rounded logits),
    masked tokens (-inf) and top_k beyond the unmasked count, as the sampler's filters see them;
    batches with both filters, with top-p alone and with top-k alone."""
    rng = np.random.default_rng(6)
    checked = ambiguous = 0
    for trial in range(24):
        rows, vocab = 16, [7, 64, 1000, 32000][trial % 4]
        x = (rng.normal(size=(rows, vocab)) * [0.1, 1.0, 10.0][trial % 3]).astype(np.float32)
        if trial % 2:
            x = np.round(x, 1)   # ties
        if trial % 3 == 0:
            x[:, rng.random(vocab) < 0.7] = -np.inf   # a grammar's mask
            x[:, 0] = 0.0
        top_k = rng.choice([0, 1, 2, 5, 50, vocab, vocab + 3], size=rows).astype(np.int32)
        top_p = rng.choice([1.0, 0.95, 0.5, 0.1, 1e-3], size=rows).astype(np.float32)
        if trial // 4 % 3 == 1:   # no row asks for top-k (its select is skipped), or none for top-p
            top_k = rng.choice([0, vocab, vocab + 3], size=rows).astype(np.int32)
        elif trial // 4 % 3 == 2:
            top_p[:] = 1.0
        got = np.asarray(_top_k_top_p_threshold(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
        got = got[:, 0]
        # a GPU's multi-step decode: no conditional, both selects run; the same thresholds
        branch_free = _top_k_top_p_threshold(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p), True)
        np.testing.assert_array_equal(np.asarray(branch_free)[:, 0], got)
        for i in range(rows):
            want, close = threshold_oracle(x[i], int(top_k[i]), float(top_p[i]))
            ambiguous += close
            checked += not close
            assert close or got[i] == want, (trial, i, top_k[i], top_p[i], got[i], want)
    assert checked > 360 and ambiguous < 8
    no_filter = _top_k_top_p_threshold(jnp.zeros((2, 5)), jnp.array([0, 9]), jnp.array([1.0, 1.0]))
    assert np.all(np.asarray(no_filter) == -np.inf)   # the select does not run


def test_temperature_sampling_follows_softmax_over_temperature():
    rng = np.random.default_rng(4)
    vocab, rows, steps, temperature = 8, 2048, 10, 0.7
    row = rng.normal(size=vocab).astype(np.float32)
    md = build([P(temperature=temperature)] * rows, seeds=list(range(1000, 1000 + rows)))
    logits = np.broadcast_to(row, (rows, vocab))
    tokens = np.concatenate([np.asarray(sample(logits, md.replace(step=md.step + s)).tokens) for s in range(steps)])
    counts = np.bincount(tokens, minlength=vocab)

    def pvalue(t):
        return stats.chisquare(counts, softmax(row.astype(np.float64) / t) * len(tokens)).pvalue

    assert pvalue(temperature) > 1e-3
    assert pvalue(1.0) < 1e-3 and pvalue(0.5) < 1e-3


def test_seeded_rows_do_not_depend_on_the_batch():
    """Same seed, same logits -> same tokens over steps, whatever the batch size, position,
    padding and the other rows' settings (which switch the sort, penalty and greedy paths)."""
    rng = np.random.default_rng(5)
    vocab, steps = 512, 8
    step_logits = rng.normal(size=(steps, vocab)).astype(np.float32) * 2
    targets = [P(temperature=0.9), P(temperature=1.2, top_k=40, top_p=0.9, min_p=0.01)]
    others = [P(temperature=0.0), P(top_k=20), P(top_p=0.5, repetition_penalty=1.2), P(temperature=0.3)]

    def run(target, seed, slot, neighbours, pad_to):
        out = []
        for s in range(steps):
            params = list(neighbours)
            params.insert(slot, target)
            seeds = rng.integers(0, 2**31, size=len(params)).tolist()
            seeds[slot] = seed
            outputs = [rng.integers(0, vocab, size=s).tolist() for _ in params]
            outputs[slot] = out
            logits = rng.normal(size=(pad_to, vocab)).astype(np.float32)
            logits[slot] = step_logits[s]
            md = build(params, seeds=seeds, prompts=[[1, 2, 3]] * len(params), outputs=outputs, pad_to=pad_to)
            out = out + [int(sample(logits, md).tokens[slot])]
        return out

    for target in targets:
        alone = run(target, 1234, 0, [], 1)
        assert len(set(alone)) > 1
        assert run(target, 1234, 3, others, 8) == alone
        assert run(target, 1234, 1, others[:2], 4) == alone
        assert run(target, 1234, 0, [P(temperature=0.0)], 2) == alone
        assert run(target, 4321, 0, [], 1) != alone


def test_logit_bias_and_min_tokens_ban_match_reference():
    """Greedy rows pick the argmax of logits + bias (numpy); min_tokens bans a row's ending tokens
    (-inf) until it has that many outputs; logprobs stay those of the raw logits; a batch with no
    bias sends none (width 0)."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 64)).astype(np.float32)
    logits[:, 9] = 50.0                              # token 9 (an "eos") would win every row
    params = [P(temperature=0.0, logit_bias={5: 100.0}),
              P(temperature=0.0, logit_bias={9: -100.0, 3: 2.5, 17: -1.0}),
              P(temperature=0.0, min_tokens=2, logprobs=1),
              P(temperature=0.0, min_tokens=2),
              P(temperature=0.0)]
    outputs = [[], [], [1], [1, 2], []]
    ends = [(9,), (9,), (9, 11), (9,), (9,)]
    md = SamplingMetadata.build(params, [[0]] * 5, outputs, list(range(5)), 8, end_token_ids=ends)
    out = sample(np.pad(logits, ((0, 3), (0, 0))), md, num_logprobs=1)
    ref = logits.astype(np.float64)
    ref[0, 5] += 100.0
    ref[1, [9, 3, 17]] += [-100.0, 2.5, -1.0]
    ref[2, [9, 11]] = -np.inf                         # 1 output < min_tokens 2: banned
    np.testing.assert_array_equal(np.asarray(out.tokens)[:5], ref.argmax(-1))
    assert out.tokens[0] == 5 and out.tokens[2] != 9 and out.tokens[3] == 9 and out.tokens[4] == 9
    np.testing.assert_allclose(out.logprobs[2], log_softmax(logits[2])[out.tokens[2]], atol=1e-5)
    assert build([P(min_tokens=1)], outputs=[[4]]).bias_ids.shape == (1, 0)   # no end ids given
    assert build([P()]).bias_ids.shape == (1, 0)


def test_the_branch_free_sampler_draws_what_the_conditional_one_does():
    """sample(filters=True/False) (a GPU's multi-step decode: no conditional) against
    filters=None: the same tokens for greedy, random, top-k, top-p and min-p rows; logprobs always
    computed, equal to the conditional sampler's where a row asked for them."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 1000)).astype(np.float32) * 3
    cases = {False: [P(temperature=0.0), P(temperature=0.8, seed=1), P(temperature=1.2, min_p=0.05),
                     P(temperature=0.0, logprobs=3)],
             True: [P(temperature=0.7, top_k=9), P(temperature=1.0, top_p=0.6), P(temperature=0.0, logprobs=2),
                    P(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02)]}
    for filters, params in cases.items():
        md = build(params, pad_to=6)
        assert uses_filters(md, 1000) is filters
        with_conditionals, branch_free = sample(logits, md, num_logprobs=3), sample(logits, md, num_logprobs=3,
                                                                                     filters=filters)
        np.testing.assert_array_equal(branch_free.tokens, with_conditionals.tokens)
        np.testing.assert_allclose(branch_free.logprobs, with_conditionals.logprobs, atol=1e-6)
        np.testing.assert_array_equal(branch_free.top_ids, with_conditionals.top_ids)
    greedy_only = build([P(temperature=0.0)] * 2)
    assert np.any(sample(logits[:2], greedy_only, num_logprobs=2, filters=False).logprobs)   # computed anyway
    assert not np.any(sample(logits[:2], greedy_only, num_logprobs=2).logprobs)


def test_a_penalised_rows_history_is_its_known_tokens_then_pending_ones():
    """metadata_for's history for a penalised row: its prompt and known outputs (from the int32
    copy kept on the Sequence, grown step by step), then -1 for each PENDING output (not the
    launched step's own), as the lists give it; the copy follows outputs cut after a stop."""
    from jaxserve.sequence import PENDING, Sequence
    seq = Sequence(request_id="r", prompt_token_ids=[5, 6, 7], sampling=P(presence_penalty=0.5))
    seq.output_token_ids = list(range(100, 190))
    for step in range(3):   # known outputs grow; PENDING ones at the end
        seq.output_token_ids += [200 + step, PENDING]
        md = metadata_for([seq], {seq.seq_id: 0}, rows=1, max_model_len=256)
        want = [5, 6, 7] + seq.output_token_ids
        assert md.history[0, :len(want)].tolist() == want and (md.history[0, len(want):] == -1).all()
        assert md.prompt_len[0] == 3 and md.step[0] == len(seq.output_token_ids)
        launched = metadata_for([seq], {seq.seq_id: 0}, rows=1, max_model_len=256, launched=True)
        assert launched.history[0, :len(want) - 1].tolist() == want[:-1] and launched.step[0] == len(want) - 4
        seq.output_token_ids[-1] = 300 + step   # the step is collected
    assert seq.known_token_array().tolist() == [5, 6, 7] + seq.output_token_ids
    del seq.output_token_ids[50:]   # a stop found late
    assert seq.known_token_array().tolist() == [5, 6, 7] + seq.output_token_ids
