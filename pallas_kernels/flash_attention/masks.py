"""The one mask description of the flash-attention kernels, and the block schedule it implies.

A token pair (query i, key j) of one row is visible when both tokens carry the same segment id
(several prompts packed into one row), j <= i (causal), and j > i - sliding_window.
Both kernels cut the [T, T] score matrix into [block_q, block_kv] tiles. `block_schedule` says,
for each q block, which kv blocks it must visit (EMPTY tiles are never loaded): the FULL ones
(every pair visible, so the kernel skips masking) first, then the PARTIAL ones (mask applied).
Online softmax takes its tiles in any order; FULL first lets a kernel run two loops, one without
mask code, instead of a branch per tile.
Segment ids are runtime data, so the schedule is computed with jnp inside the jitted call; without
them it depends on shapes alone and is computed with numpy: constants in the compiled call, not
kernels launched before it (XLA:GPU left two of those for the jnp version).
"""
import dataclasses
import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2
MASK_VALUE = -1e30  # finite: a row masked in one tile is wiped out by the next tile's rescale


@dataclasses.dataclass(frozen=True)
class Mask:
    causal: bool = True
    sliding_window: int | None = None

    def __post_init__(self):
        if self.sliding_window is not None and (not self.causal or self.sliding_window < 1):
            raise ValueError("sliding_window needs causal=True and a window of at least 1")

    def visible(self, q_pos, kv_pos, q_seg, kv_seg):
        """Elementwise (broadcasting) visibility of token pairs; what PARTIAL tiles apply. Segment
        ids None: one segment."""
        ok = True if q_seg is None else q_seg == kv_seg
        if self.causal:
            ok = ok & (kv_pos <= q_pos)
        if self.sliding_window is not None:
            ok = ok & (kv_pos > q_pos - self.sliding_window)
        return ok

    def classify_blocks(self, segment_ids, block_q, block_kv):
        """int32 [B, T // block_q, T // block_kv]: EMPTY / PARTIAL / FULL per tile.

        Positions are static (numpy); segments use each block's [min, max] id range, which is
        exact for packed rows (ids non-decreasing along T) and conservative (PARTIAL instead of
        EMPTY or FULL, never wrong) for any other layout."""
        xp = np if isinstance(segment_ids, np.ndarray) else jnp
        b, t = segment_ids.shape
        q_lo = np.arange(t // block_q)[:, None] * block_q  # first / last position of each block
        q_hi = q_lo + block_q - 1
        kv_lo = np.arange(t // block_kv)[None, :] * block_kv
        kv_hi = kv_lo + block_kv - 1
        any_pos = np.ones((q_lo.size, kv_lo.size), bool)
        all_pos = np.ones_like(any_pos)
        if self.causal:
            any_pos &= kv_lo <= q_hi
            all_pos &= kv_hi <= q_lo
        if self.sliding_window is not None:
            any_pos &= kv_hi > q_lo - self.sliding_window
            all_pos &= kv_lo > q_hi - self.sliding_window
        qs = segment_ids.reshape(b, -1, block_q)
        ks = segment_ids.reshape(b, -1, block_kv)
        q_min, q_max = qs.min(-1)[:, :, None], qs.max(-1)[:, :, None]
        kv_min, kv_max = ks.min(-1)[:, None, :], ks.max(-1)[:, None, :]
        any_seg = (q_min <= kv_max) & (kv_min <= q_max)
        all_seg = (q_min == q_max) & (kv_min == kv_max) & (q_min == kv_min)
        return xp.where(any_pos & any_seg, xp.where(all_pos & all_seg, FULL, PARTIAL), EMPTY).astype(np.int32)


class BlockSchedule(NamedTuple):
    """Per q block, the kv blocks to visit: the `full` FULL ones, then the PARTIAL ones up to
    `count`, each group in ascending order. Slots past `count` repeat the last visited block, so
    a pipelined kernel sees an unchanged block index and copies nothing."""
    kv_block: jnp.ndarray  # int32 [B, nq, nk]
    full: jnp.ndarray      # int32 [B, nq]
    count: jnp.ndarray     # int32 [B, nq]


def block_schedule(mask: Mask, segment_ids, block_q, block_kv) -> BlockSchedule:
    """numpy arrays for numpy segment ids (see the module docstring), else jnp."""
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    kinds = mask.classify_blocks(segment_ids, block_q, block_kv)
    nk = kinds.shape[-1]
    count = (kinds != EMPTY).sum(-1, dtype=np.int32)
    full = (kinds == FULL).sum(-1, dtype=np.int32)
    order = xp.argsort(FULL - kinds, axis=-1, stable=True).astype(np.int32)  # FULL, PARTIAL, EMPTY
    last = xp.take_along_axis(order, xp.maximum(count - 1, 0)[..., None], axis=-1)
    kv_block = xp.where(xp.arange(nk) < count[..., None], order, last)
    return BlockSchedule(kv_block, full, count)


def pad_to_blocks(q, k, v, segment_ids, block_q, block_kv):
    """Pad T to a multiple of both block sizes. Padding tokens get a segment id of their own
    (max + 1, so packed rows stay sorted): real tokens never see them, they see only each other.
    No segment ids: numpy ids, 0 for every token and 1 for the padding (block_schedule then
    computes with numpy)."""
    b, t = q.shape[:2]
    pad = -t % math.lcm(block_q, block_kv)
    if segment_ids is None:
        segment_ids = np.zeros((b, t + pad), np.int32)
        segment_ids[:, t:] = 1
    else:
        segment_ids = segment_ids.astype(jnp.int32)
        if pad:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=segment_ids.max() + 1)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    return q, k, v, segment_ids
