"""The packed token masks of a step's sampling rows, filled on the host for the sampler
(jaxserve/sampling.py applies them on device, before anything else picks a token)."""
from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    """int32 words per mask row: bit t % 32 of word t // 32 says whether token t may be sampled."""
    return (vocab_size + 31) // 32


def allowed_mask(token_ids, vocab_size: int) -> np.ndarray:
    """The mask row (int32 words) of SamplingParams.allowed_token_ids."""
    bits = np.zeros(mask_words(vocab_size) * 32, np.uint8)
    bits[list(token_ids)] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def token_masks(seqs: list, aheads: list[list[int]], pad_to: int) -> np.ndarray | None:
    """int32[pad_to, words]: row i holds the tokens seqs[i]'s grammar allows after aheads[i] (the
    proposals before a verify row's position), and of those only its allowed_token_ids; every bit
    set for rows with neither, for padding, and for finished sequences (a deferred sampler's rows
    of sequences that stopped meanwhile: discarded). None when no row has either (the sampler
    then skips the mask: a static shape)."""
    live = [s if not s.is_finished and (s.grammar is not None or s.allowed_mask is not None) else None for s in seqs]
    first = next((s for s in live if s is not None), None)
    if first is None:
        return None
    words = first.grammar.words if first.grammar is not None else len(first.allowed_mask)
    masks = np.full((pad_to, words), -1, np.int32)
    address, row_bytes = masks.ctypes.data, masks.strides[0]
    for i, (seq, ahead) in enumerate(zip(live, aheads)):
        if seq is not None and seq.grammar is not None:
            seq.grammar.fill(address + i * row_bytes, ahead)
        if seq is not None and seq.allowed_mask is not None:
            masks[i] &= seq.allowed_mask
    return masks
