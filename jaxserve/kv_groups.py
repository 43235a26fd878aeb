"""KV groups: the hybrid KV cache's map of layers to page pools (vLLM's hybrid KV cache manager).

A sliding-window layer (window w) only ever reads the last w positions, so its pages further back
can be given to others. Layers are grouped by their window (None: full attention): each group is
`group_size` layers (the last group of a kind padded with unused entries), and the cache holds
`group_size` page-pool entries (kv_cache.LayerKV), not one per layer. Layer l reads and writes
entry `layer_entry[l]` through the page table of group `layer_group[l]`: a page id p, allocated
to group g, is page p of every entry for g's layers. All groups take pages from one free list
(block_manager.py), so memory moves between them as sequences need it, with no fixed split.

group_size is the fewest layers of any kind (gpt-oss: 12 full + 12 window 128 -> two groups of
12; Gemma 3 27B: 10 full + 52 window 1024 -> one full group and six sliding groups of 10, the last
two of them padded by 8 entries): padding entries cost memory in every page, while a smaller
group_size multiplies the groups (page tables per sequence, a step's table arrays). A page then
holds group_size layers' K/V, so a token of a full layer costs what it did, and a sliding group
holds about w + the step's query tokens of each sequence, whatever its context.

Hybrid only where it helps: a model with no sliding layer, or with `EngineConfig.hybrid_kv_cache`
off (vLLM: --disable-hybrid-kv-cache-manager), is one full group of all its layers: today's cache,
page tables and programs, unchanged. A model whose layers all slide with one window (Mistral
v0.1) is one sliding group: today's arrays, with its old pages released.

A draft model (spec_decode/draft.py) has a pool of its own, addressed by one of the target's page
tables: group 0's, which is a full group whenever the model has full-attention layers (`of` puts
them first). A page id names a page in every pool entry, the draft's pool too, and a full group
keeps every page of a sequence until it ends, so the draft reads and writes its pages as with one
group (the draft's pool entries of the sliding groups' pages go unused). A model whose layers all
slide has no such table (released entries point at NULL_PAGE, where the draft's full-attention
layers, and its catch-up from a sequence's first token, would read): with a draft it stays one
full group of all its layers, as without the hybrid cache.

Released pages: a sliding group's page-table entry for pages out of its window points at
NULL_PAGE, which the block manager never allocates (so it holds zeros forever: a poisoned or
reused page cannot leak NaN through a zero attention weight into a kernel's PV product).
"""
from __future__ import annotations

import dataclasses

NULL_PAGE = 0   # reserved while any group slides: released entries point at it


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]   # per group: its layers' sliding window, None for full attention
    layer_group: tuple[int, ...]      # per model layer: its group
    layer_entry: tuple[int, ...]      # per model layer: its page-pool entry (0 .. group_size - 1)
    group_size: int

    @classmethod
    def of(cls, sliding_windows: tuple[int | None, ...], enabled: bool = True) -> "KVGroups":
        """The groups of a model whose layer l has window sliding_windows[l] (None: full)."""
        n = len(sliding_windows)
        kinds = sorted(set(sliding_windows), key=lambda w: (w is not None, w or 0))
        if not enabled or kinds == [None]:
            return cls((None,), (0,) * n, tuple(range(n)), n)
        layers = {w: [i for i, x in enumerate(sliding_windows) if x == w] for w in kinds}
        size = min(len(v) for v in layers.values())
        windows, group, entry = [], [0] * n, [0] * n
        for w in kinds:
            for start in range(0, len(layers[w]), size):
                for e, layer in enumerate(layers[w][start:start + size]):
                    group[layer], entry[layer] = len(windows), e
                windows.append(w)
        return cls(tuple(windows), tuple(group), tuple(entry), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether any group slides (and NULL_PAGE is reserved)."""
        return any(w is not None for w in self.windows)


def kv_groups(cfg, ecfg) -> KVGroups:
    """An engine's groups: its model's sliding windows (one as long as max_model_len releases
    nothing: full), hybrid unless the config turns it off, or a draft model needs a full group's
    page table and no layer is full (see the module docstring)."""
    draft = ecfg.speculative is not None and ecfg.speculative.method == "draft"
    max_len = ecfg.max_model_len or cfg.max_position_embeddings
    windows = tuple(w if w is not None and w < max_len else None for w in cfg.sliding_windows)
    return KVGroups.of(windows, ecfg.hybrid_kv_cache and not (draft and None not in windows))
