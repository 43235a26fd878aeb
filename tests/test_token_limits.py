"""jaxserve/token_limits.py's bad-word rules, as vLLM's (the sampler applying them:
tests/test_server_extras.py::test_bad_words_match_transformers)."""
import numpy as np
import pytest

from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.structured.masks import mask_words
from jaxserve.token_limits import banned_by_bad_words, bad_words_token_ids, check_token_ids, sequence_limits


class FoldingTokenizer:
    """A tokenizer that folds a leading space into a word's first token, as SentencePiece's do."""
    VOCAB = {"cat": [5], " cat": [6], "hot dog": [7, 8], " hot dog": [9, 8], "big cat": [1, 5], " big cat": [1, 2, 5]}

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return self.VOCAB[text]


def test_words_become_their_tokens_and_their_spaced_tokens_of_the_same_count():
    words = bad_words_token_ids(FoldingTokenizer(), ("cat", "  hot dog", "big cat"))
    assert words == ((5,), (6,), (7, 8), (9, 8), (1, 5))   # " big cat" is 3 tokens: not a form of the word


def test_a_words_last_token_is_banned_where_the_outputs_end_in_the_rest():
    words = ((5,), (7, 8), (1, 2, 3))
    assert banned_by_bad_words(words, []) == [5]
    assert banned_by_bad_words(words, [4, 7]) == [5, 8]
    assert banned_by_bad_words(words, [1, 2]) == [5, 3]
    assert banned_by_bad_words(words, [2]) == [5]
    assert banned_by_bad_words(words, range(0)) == [5]


def test_limits_are_checked():
    with pytest.raises(InvalidRequest, match="bad_words must hold at most 64 words, none empty"):
        SamplingParams(bad_words=["ok", " "])
    with pytest.raises(InvalidRequest, match="allowed_token_ids must hold at least one token id"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(InvalidRequest, match=r"allowed_token_ids token ids out of range \[0, 10\): \[10\]"):
        check_token_ids([1, 2], SamplingParams(allowed_token_ids=[3, 10]), 10)
    limits = sequence_limits(SamplingParams(allowed_token_ids=[0, 33]), FoldingTokenizer(), 40)
    bits = np.unpackbits(limits["allowed_mask"].view(np.uint8), bitorder="little")
    assert len(limits["allowed_mask"]) == mask_words(40) and np.flatnonzero(bits).tolist() == [0, 33]
