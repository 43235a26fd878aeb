"""Streamed text of a choice (jaxserve/outputs.py): the deltas that `Request.take_text` hands out,
cut by `cut_at_stop_string`, against the whole text cut by a plain search."""
import random

import pytest

from jaxserve.outputs import Request
from jaxserve.sampling_params import SamplingParams


def stream(pieces, stop, include):
    """The engine's per-token calls (engine._advance): the deltas sent, and the longest text held."""
    req = Request("r", [1], SamplingParams(max_tokens=len(pieces), stop=stop, include_stop_str_in_output=include),
                  0.0, [None], texts=[""], emitted=[0])
    sent, held = [], 0
    for piece in pieces:
        req.texts[0] += piece
        held = max(held, len(req.texts[0]))
        stopped = bool(stop) and req.cut_at_stop_string(0)
        sent.append(req.take_text(0, finished=stopped))
        if stopped:
            break
    else:
        sent.append(req.take_text(0, finished=True))
    return "".join(sent), held


def oracle(pieces, stop, include):
    """The whole text, cut where a stop string first appears (its earliest match then)."""
    text = ""
    for piece in pieces:
        text += piece
        found = [(text.find(s), s) for s in stop if s in text]
        if found:
            pos, s = min(found)
            return text[:pos + len(s) if include else pos]
    return text


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_is_the_text_cut_at_the_first_stop_string(seed):
    rng = random.Random(seed)
    alphabet = "ab c"
    pieces = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(300)]
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6))) for _ in range(rng.randint(0, 2))]
    include = rng.random() < 0.5
    text, held = stream(pieces, stop, include)
    assert text == oracle(pieces, stop, include)
    # What is held is the unsent text and a stop string's length before it, not the output so far.
    assert held <= 4 + 2 * max(map(len, stop), default=0), held
