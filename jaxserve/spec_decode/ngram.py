"""n-gram prompt lookup: no model, the sequence's own tokens. Text that repeats what came
before (code, quotes, structured answers) is guessed right for free."""
from __future__ import annotations

import numpy as np


def propose(token_ids: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """num_tokens tokens that followed the latest earlier occurrence of the last n tokens, for
    the longest n in [ngram_min, ngram_max] that occurs; [] when none does.

    The copy overlaps itself as in LZ77: a match p tokens back says the text repeats with
    period p, so the guess goes on past the sequence's end (a loop of period 1 proposes
    num_tokens copies of its token, not one)."""
    tokens = np.asarray(token_ids, np.int64)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        # windows tokens[i:i+n] for i < len - n: every earlier occurrence, with a token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            period = len(tokens) - start
            return tokens[start + np.arange(num_tokens) % period].tolist()
    return []
