"""Structured output in the engine: the sampler's packed mask against a numpy oracle, the
matcher's look-ahead for verify rows, 34 JSON schemas / regexes / choices in one engine run
(every output checked by `jsonschema` and `re`, no compilation after warm-up), a grammar that
waits for a marker, speculative decoding under a grammar. Through the server:
tests/test_structured_server.py."""
import dataclasses
import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from jaxserve.engine import TINY_MODEL_DIR
from jaxserve.sampling import SamplingMetadata, sample
from jaxserve.sampling_params import SamplingParams as P
from jaxserve.structured import StructuredOutput
from jaxserve.structured.grammar import Grammars
from jaxserve.tokenizer import load_tokenizer
from tests.structured_cases import CHOICES, ENGINE, NAME, POINT, REGEX, TAGS, schemas, warm_llm

# ---- the sampler's mask against numpy ----


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool[S, V] -> int32[S, ceil(V / 32)], bit t % 32 of word t // 32 (numpy, as the oracle)."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, -(-vocab // 32) * 32), bool)
    padded[:, :vocab] = allowed
    weights = (1 << np.arange(32, dtype=np.uint64))
    return (padded.reshape(rows, -1, 32) * weights).sum(-1).astype(np.uint32).view(np.int32)


def test_sampler_mask_against_numpy():
    rng = np.random.default_rng(0)
    rows, vocab = 6, 100   # not a multiple of 32: the last word is part padding
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[:, 99] = True            # the last token, in the last word's high bits
    allowed[5] = True                # an unconstrained row: every bit set
    params = [P(temperature=0.0, logprobs=0)] * 3 + [P(temperature=1.0, seed=1), P(temperature=0.7, top_k=5, seed=2),
                                         P(temperature=0.0, logit_bias={int(np.argmin(logits[5])): 100.0})]
    md = SamplingMetadata.build(params, [[0]] * rows, [[]] * rows, list(range(rows)), rows, allowed=pack(allowed))
    assert md.use_mask and md.use_bias
    out = sample(logits, md, num_logprobs=3)
    tokens = np.asarray(out.tokens)
    masked = np.where(allowed, logits, -np.inf)
    np.testing.assert_array_equal(tokens[:3], masked[:3].argmax(-1))        # greedy: the masked argmax
    assert all(allowed[i, tokens[i]] for i in range(rows))                  # sampled: always allowed
    assert tokens[5] == np.argmin(logits[5])                                 # the bias still applies
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))             # logprobs: the raw model's
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[np.arange(rows), tokens], rtol=1e-5, atol=1e-5)
    for seed in range(20):   # random rows over many draws: never a masked-out token
        md = SamplingMetadata.build([P(temperature=1.5, seed=seed)] * rows, [[0]] * rows, [[]] * rows,
                                    list(range(rows)), rows, allowed=pack(allowed))
        tokens = np.asarray(sample(logits, md).tokens)
        assert all(allowed[i, tokens[i]] for i in range(rows))


def test_min_tokens_ban_yields_to_the_grammar():
    """min_tokens bans a row's ending tokens; where that takes every token its grammar allows,
    the grammar wins (an empty row would sample token 0, which no grammar allowed)."""
    rows, vocab = 4, 100
    logits = np.random.default_rng(2).normal(size=(rows, vocab)).astype(np.float32)
    allowed = np.zeros((rows, vocab), bool)
    allowed[:3, 7] = True                 # rows 0-2: the grammar allows only the ending token 7 ...
    allowed[1, 9] = True                  # ... and row 1 also 9, which the ban leaves
    allowed[3] = True                     # row 3: no grammar; its ban holds
    ends = [(7,)] * 3 + [(int(logits[3].argmax()),)]
    params = [P(temperature=0.0, min_tokens=3), P(temperature=0.0, min_tokens=3), P(temperature=1.0, seed=3, min_tokens=3),
              P(temperature=0.0, min_tokens=3)]
    md = SamplingMetadata.build(params, [[0]] * rows, [[]] * rows, list(range(rows)), rows, end_token_ids=ends,
                                allowed=pack(allowed))
    assert md.use_mask and md.use_bias
    tokens = np.asarray(sample(logits, md).tokens).tolist()
    assert tokens[:3] == [7, 9, 7]
    assert tokens[3] == np.argsort(logits[3])[-2]


def test_mask_variant_equals_full_variant():
    """A constrained batch without penalties or a bias takes the mask-only sampler variant; with a
    zero bias (which changes nothing) the same batch takes the variant with all three: the same
    tokens and logprobs, greedy and seeded."""
    rng = np.random.default_rng(1)
    rows, vocab = 8, 300
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    allowed = pack(rng.random((rows, vocab)) < 0.2)
    params = [P(temperature=0.0, logprobs=2), P(temperature=1.0, seed=3), P(temperature=0.8, top_p=0.9, seed=4),
              P(temperature=0.7, top_k=5, min_p=0.05, seed=5)] * 2
    outs = []
    for bias in ({}, {0: 0.0}):
        md = SamplingMetadata.build([dataclasses.replace(p, logit_bias=bias) for p in params], [[1, 2]] * rows,
                                    [[3]] * rows, list(range(rows)), rows, allowed=allowed)
        assert md.use_mask and md.use_bias == md.use_penalties == bool(bias)
        outs.append(jax.device_get(sample(logits, md, num_logprobs=2)))
    for mask_only, full in zip(*outs):
        np.testing.assert_array_equal(mask_only, full)


def allowed_ids(row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))


def test_matcher_look_ahead_rolls_back():
    """A verify row's position j is masked as if the proposals before it were taken (here: the
    path of each step's last allowed token), and the matcher is left where it was."""
    tok = load_tokenizer(TINY_MODEL_DIR)
    grammars = Grammars(tok, 4096, tok.eos_token_ids)
    constraint = StructuredOutput.json_schema(POINT)
    [m, walker] = grammars.matchers(constraint, 2)
    masks = np.zeros((4, m.words), np.int32)
    m.fill(masks[0].ctypes.data)
    ahead = []
    for _ in range(3):
        walker.fill(masks[1].ctypes.data)
        ahead.append(int(allowed_ids(masks[1])[-1]))
        assert not walker.accept(ahead[-1])
    walker.fill(masks[1].ctypes.data)   # the oracle: a matcher that took the path
    m.fill(masks[2].ctypes.data, ahead)
    m.fill(masks[3].ctypes.data)
    np.testing.assert_array_equal(masks[2], masks[1])
    np.testing.assert_array_equal(masks[3], masks[0])   # rolled back
    assert not np.array_equal(masks[0], masks[1])


def test_sentencepiece_tokenizer_gives_the_same_masks():
    """A model with only tokenizer.model: its pieces as bytes for llguidance give the masks that
    tokenizer.json gives (the tiny model ships both)."""
    from jaxserve.tokenizer import SentencePieceTokenizer

    hf, sp = load_tokenizer(TINY_MODEL_DIR), SentencePieceTokenizer(TINY_MODEL_DIR)
    constraint = StructuredOutput.json_schema({"type": "object", "properties": {"name": NAME, "tags": TAGS},
                                               "required": ["name", "tags"]})
    [a] = Grammars(hf, 4096, hf.eos_token_ids).matchers(constraint, 1)
    [b] = Grammars(sp, 4096, sp.eos_token_ids).matchers(constraint, 1)
    masks = np.zeros((2, a.words), np.int32)
    for _ in range(12):   # along the path of each step's last allowed token
        a.fill(masks[0].ctypes.data)
        b.fill(masks[1].ctypes.data)
        np.testing.assert_array_equal(masks[0], masks[1])
        token = int(allowed_ids(masks[0])[-1])
        assert a.accept(token) == b.accept(token)


# ---- 34 constraints in one engine run ----

@pytest.fixture(scope="module")
def llm():
    return warm_llm()


def test_schemas_regexes_and_choices_in_one_run(llm):
    from jaxserve.compilations import CompileCounter

    before = CompileCounter.count
    cases = [(StructuredOutput.json_schema(s), s) for s in schemas()]
    prompts, params = [], []
    for i, (constraint, _) in enumerate(cases):   # greedy and seeded sampling, n = 2 on some
        prompts.append(f"Example {i} as JSON:")
        params.append(P(max_tokens=96, temperature=0.0 if i % 2 else 0.9, seed=i, n=2 if i % 7 == 0 else 1,
                        structured_output=constraint))
    prompts += ["The code is", "Is a list mutable?", "The id and the rest"]
    params += [P(max_tokens=24, temperature=0.8, seed=1, n=2, structured_output=StructuredOutput("regex", REGEX)),
               P(max_tokens=8, temperature=1.0, seed=2, n=3, structured_output=StructuredOutput("choice", CHOICES)),
               # a stop string inside the grammar's language ends the output there
               P(max_tokens=24, temperature=0.0, stop=[";"],
                 structured_output=StructuredOutput("regex", r"[a-z]{1,5};[0-9]{1,3}"))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert CompileCounter.count == before, "a constrained batch compiled after warm-up"
    checked = [(schema, c) for (_, schema), out in zip(cases, outputs) for c in out.outputs]
    assert len(checked) >= 34
    for schema, c in checked:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    regex, choice, stopped = outputs[-3:]
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in regex.outputs), regex.outputs
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in choice.outputs), choice.outputs
    assert re.fullmatch(r"[a-z]{1,5}", stopped.outputs[0].text) and stopped.outputs[0].finish_reason == "stop"


def test_a_stop_token_the_grammar_requires_before_min_tokens(llm):
    """7{20} allows only '7' at each step. With '7' a stop token and min_tokens 5, the first 5 are
    ordinary tokens (the ban would leave the grammar nothing) and the 6th ends the output (its
    token among the ids, its text not in the output)."""
    free = llm.generate(["Count:"], P(max_tokens=3, temperature=0.0, structured_output=StructuredOutput("regex", "7{20}")),
                        use_tqdm=False)[0].outputs[0]
    seven = free.token_ids[0]
    assert free.text == "777" and free.token_ids == [seven] * 3
    for params in (P(temperature=0.0), P(temperature=1.0, seed=1, n=2)):
        out = llm.generate(["Count:"], dataclasses.replace(params, max_tokens=30, min_tokens=5, stop_token_ids=[seven],
                                                           structured_output=StructuredOutput("regex", "7{20}")),
                           use_tqdm=False)[0]
        assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == \
            [("77777", [seven] * 6, "stop")] * params.n


def test_a_grammar_that_waits_for_the_end_of_thinking(llm):
    """StructuredOutput.after (a thinking model's </think>, here a piece of the model's own greedy
    text, several tokens long): the output is token for token the free one until it holds the
    marker, then keeps to the grammar; with n = 2 seeded choices each switches where its own text
    holds it."""
    token_bytes = llm.llm_engine.grammars.token_bytes
    free = llm.generate(["The for statement is used to"], P(max_tokens=40, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    raw = b"".join(token_bytes(t) for t in free)
    marker = raw[len(raw) // 3:len(raw) // 3 + 6].decode()
    j = next(j for j in range(len(free) + 1) if marker.encode() in b"".join(token_bytes(t) for t in free[:j]))
    assert 2 <= j < len(free) - 3
    waits = StructuredOutput("regex", "[0-9]{3}", after=marker)
    [out] = llm.generate(["The for statement is used to"], P(max_tokens=40, temperature=0.0, structured_output=waits),
                         use_tqdm=False)[0].outputs
    assert out.token_ids[:j] == free[:j] and out.finish_reason == "stop"
    assert re.fullmatch(rb"[0-9]{3}", b"".join(token_bytes(t) for t in out.token_ids[j:]))
    for c in llm.generate(["The for statement is used to"], P(max_tokens=60, temperature=1.0, seed=4, n=2,
                                                              structured_output=waits), use_tqdm=False)[0].outputs:
        head, digits = c.text.split(marker, 1) if marker in c.text else (c.text, None)
        assert (digits is not None and re.fullmatch("[0-9]{3}", digits) and c.finish_reason == "stop") or \
            (digits is None and c.finish_reason == "length"), c.text


def test_speculative_decoding_keeps_to_the_grammar(llm):
    """n-gram proposals are checked against the grammar (each verify position masked as if the
    proposals before it were taken): greedy outputs equal those without speculation. The last
    case, 7{20}, leaves one token ('7') at each step whatever the model, so proposals drawn from
    the earlier 7s must be accepted on any CPU's numerics."""
    from jaxserve import LLM

    spec = LLM(model=None, **ENGINE, speculative={"method": "ngram", "num_tokens": 3, "ngram_min": 1, "ngram_max": 3})
    cases = [StructuredOutput.json_schema(s) for s in schemas()[::4]] + [StructuredOutput("regex", REGEX),
                                                                         StructuredOutput("regex", REGEX, after=" "),
                                                                         StructuredOutput("regex", "7{20}")]
    params = [P(max_tokens=64, temperature=0.0, structured_output=c) for c in cases]
    prompts = [f"Example {i} as JSON:" for i in range(len(cases))]
    expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == expected and got[-1] == "7" * 20
    assert spec.llm_engine.stats["spec_accepted_tokens"] > 0


def test_bad_constraints_fail_when_built():
    for c, words in [(StructuredOutput.json_schema({"type": "strin"}), "strin"),
                     (StructuredOutput("regex", "a(b"), "unclosed"),
                     (StructuredOutput("choice", ()), "non-empty"),
                     (StructuredOutput.json_schema({"not": {"type": "string"}}), "Unimplemented keys")]:
        with pytest.raises(ValueError, match=words) as e:
            P(structured_output=c)
        assert e.value.param == "structured_output"
