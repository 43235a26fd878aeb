"""The tokens a request may sample besides its grammar's: its token ids checked against the
vocabulary, SamplingParams.allowed_token_ids as a mask row (jaxserve/structured/masks.py's
format), and SamplingParams.bad_words as token ids, whose last tokens the sampler bans where the
outputs end in the rest (vLLM's rules)."""
from __future__ import annotations

from jaxserve.sampling_params import InvalidRequest, SamplingParams
from jaxserve.structured.masks import allowed_mask


def check_token_ids(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    """InvalidRequest naming the field whose token ids fall outside the vocabulary."""
    for name, ids in (("prompt", prompt_token_ids), ("logit_bias", list(params.logit_bias)),
                      ("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids or ())):
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise InvalidRequest(f"{name} token ids out of range [0, {vocab_size}): {bad[:5]}", param=name)


def sequence_limits(params: SamplingParams, tokenizer, vocab_size: int) -> dict:
    """A request's Sequence fields for its limits (shared by its choices)."""
    return {"allowed_mask": None if params.allowed_token_ids is None else allowed_mask(params.allowed_token_ids,
                                                                                        vocab_size),
            "bad_words": bad_words_token_ids(tokenizer, params.bad_words)}


def bad_words_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Bad words as token ids, as vLLM reads them: each word as it stands (leading spaces
    stripped), and after a space when that makes other tokens of the same count (a word inside
    the text, for tokenizers that fold the space into the word's first token)."""
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out.append(tuple(bare))
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(tuple(spaced))
    return tuple(out)


def banned_by_bad_words(words: tuple[tuple[int, ...], ...], outputs) -> list[int]:
    """The last tokens of the bad words whose other tokens the outputs end with."""
    n = len(outputs)
    return [w[-1] for w in words if len(w) - 1 <= n and list(outputs[n - len(w) + 1:n]) == list(w[:-1])]
