"""The packed token masks of a step's sampling rows, filled on the host for the sampler
(jaxserve/sampling.py applies them on device, before anything else picks a token)."""
from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words per mask row: bit t % 32 of word t // 32 says whether token t may be sampled."""
    return (vocab_size + 31) // 32


def token_masks(seqs: list, aheads: list[list[int]], pad_to: int) -> np.ndarray | None:
    """int32[pad_to, words]: row i holds the tokens seqs[i]'s grammar allows after aheads[i] (the
    proposals before a verify row's position); every bit set for rows without a grammar and for
    padding, and for finished sequences (a deferred sampler's rows of sequences that stopped
    meanwhile: discarded). None when no row has a grammar (the sampler then skips the mask: a
    static shape)."""
    grammars = [s.grammar if s.grammar is not None and not s.is_finished else None for s in seqs]
    words = next((g.words for g in grammars if g is not None), None)
    if words is None:
        return None
    masks = np.full((pad_to, words), -1, np.int32)
    address, row_bytes = masks.ctypes.data, masks.strides[0]
    for i, (grammar, ahead) in enumerate(zip(grammars, aheads)):
        if grammar is not None:
            grammar.fill(address + i * row_bytes, ahead)
    return masks
