"""BlockManager: the paged KV pool's bookkeeping (no device memory here).

Every page is in exactly one state:
  * used: referenced by `ref_counts[p] > 0` page-table entries (sequences may share a page);
  * cached: unreferenced but holding a page registered in the prefix cache; it is reused when a
    later prompt starts with the same tokens, and evicted (LRU) only when a page is needed;
  * free: unreferenced and holding nothing worth keeping.
Allocation takes a free page first, then evicts the least recently released cached page, so
`num_free_pages` (free + cached) is what an allocation can count on.

Prefix-cache key of page i: sha256(key of page i-1 + the page's token ids), so a key names the
whole prefix up to the end of its page. Page 0's parent is the sequence's cache salt (its
SamplingParams.cache_salt, hashed; empty without one), so sequences with different salts (tenants)
never share a page, even for equal prompts: no cross-tenant hit, and no time-to-first-token
difference that would tell one tenant what another has sent. A LoRA adapter (Sequence.lora_id, one
for each time an adapter is loaded: a name reloaded with other weights gets another) salts the root
too: its K/V are not the base model's nor another adapter's. Only full pages whose K/V are computed get keys, and a
full page is never written again, so a cached page can be shared without copying.

Partial pages: a sequence that ends (or is preempted) inside a page registers that page too, keyed
the same way by its computed, known tokens (fewer than a page's). A later prompt that goes on from
there (a conversation's next turn, a beam search round: jaxserve/beam_search.py) shares it as its
last cached page and computes only its tokens after; the page is copied before the first write
into it, as below, so the cached one keeps what its key names.

Copy-on-write: a sequence about to write into a page it shares (a fork of an n > 1 request, see
the scheduler), or into a page registered in the prefix cache, gets a fresh page first; `reserve`
returns the (src, dst) copies for the runner to apply on device before the step's K/V writes.

Speculation (a verify row writes the K/V of k proposed tokens past the known ones): `reserve`
takes pages for tokens ahead of the known tokens as for any others, and `rollback` forgets the
K/V of a sequence's last tokens (the rejected proposals) by bookkeeping alone: pages wholly past
the new end are released, and the sequence drops the prefix-cache keys of pages no longer full.
The prefix cache itself needs no change: only full pages of computed, known tokens are ever
registered (so a rolled-back proposal never is, as long as the rollback precedes
`cache_full_pages`), and a registered page is never written again, since `reserve` gives the
writer a copy first. A registered page that a rollback ends inside therefore keeps the K/V its
key names, and one wholly past the end is released to the cache like any other.

Stale pages (`track_stale_pages`, for a test build): every page released to the free list or
taken for a new owner (from the free list or evicted from the prefix cache) is recorded until
`drain_stale_pages`; its K/V means nothing to anyone, so the engine may overwrite it with garbage.

KV groups (the hybrid KV cache, jaxserve/kv_groups.py): a sequence has one page table per group
(seq.page_tables), all drawing on the one pool; reserve, rollback, fork and free work on every
table, and the counts (pool short, preemption) are their sum. A step whose first query position
is s reads a sliding group of window w only from s - w + 1 on, and num_computed_tokens only grows
(a rollback stays at or past s; preemption frees everything): so `reserve` releases the group's
pages wholly before s - w + 1 for good. Their entries become NULL_PAGE (never allocated: zeros, so
the kernels' masked reads of it are harmless; released entries are always a prefix of the table),
the pages go to the cache if registered, else to the free list. A fork shares a sliding table
only while the source holds the pages the fork's next position reads (else it is prefilled).
Prefix caching: page i of every group is registered under group 0's key of page i, in the group's
own key -> page map; eviction is LRU over all groups. A hit of n pages needs the full groups'
pages 0..n-1 and each sliding group's pages from the one of position n * page_size - w + 1 on
(earlier entries NULL_PAGE): `match_prefix` shrinks it until every group holds them (searching
each sliding group from the right, as vLLM does); a partial last page must be in every group.
"""
from __future__ import annotations

import collections
import hashlib
import json
from array import array
from typing import NamedTuple

from jaxserve.kv_groups import NULL_PAGE, KVGroups
from jaxserve.sequence import PageTable, Sequence


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_key(cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """The parent key of a sequence's first page (b"": no salt, the base model)."""
    if cache_salt is None and lora_id is None:
        return b""
    return hashlib.sha256(json.dumps(["salt", cache_salt, lora_id]).encode()).digest()


def sequence_pages(windows: tuple[int | None, ...], page_size: int, num_tokens: int, query_tokens: int) -> int:
    """The most pages one sequence of num_tokens tokens holds at once in groups of these windows,
    with steps of at most query_tokens tokens: a sliding group's window and a step's tokens."""
    n = -(-num_tokens // page_size)
    return sum(n if w is None else min(n, -(-(w - 1 + query_tokens) // page_size) + 1) for w in windows)


class PrefixHit(NamedTuple):
    """Cached pages holding a prompt's first `num_tokens` tokens, and the keys of the full ones (the
    last page may be a partial one, without a key here): group 0's pages, then groups 1..'s
    (NULL_PAGE where out of a sliding window)."""
    pages: list[int]
    keys: list[bytes]
    num_tokens: int
    group_pages: tuple[list[int], ...] = ()


NO_HIT = PrefixHit([], [], 0)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 track_stale_pages: bool = False, groups: KVGroups | None = None):
        self.windows = groups.windows if groups is not None else (None,)
        self.reserved = int(any(w is not None for w in self.windows))   # NULL_PAGE, never allocated
        if num_pages < 1 + self.reserved or page_size < 1:
            raise ValueError(f"need num_pages >= {1 + self.reserved} and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size, self.enable_prefix_caching = num_pages, page_size, enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages = collections.deque(range(self.reserved, num_pages))
        self.group_cached = [{} for _ in self.windows]          # per group: key -> page (group 0's: cached_page)
        self.cached_page = self.group_cached[0]
        self.page_key = {}                                      # page -> key, for every cached page
        self.page_group = {}                                    # page -> its group, likewise
        self.evictable = collections.OrderedDict()              # unreferenced cached pages, LRU first
        self.prefix_queried_tokens = self.prefix_hit_tokens = 0
        self.stale_pages: list[int] | None = [] if track_stale_pages else None

    # ---- stats ----
    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: free plus unreferenced cached (evictable) pages."""
        return len(self.free_pages) + len(self.evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self.evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.reserved - self.num_free_pages

    @property
    def usage(self) -> float:
        return self.num_used_pages / (self.num_pages - self.reserved)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _first_needed(self, group: int, position: int) -> int:
        """The first page of `group` that a query at `position` may read (0: a full group)."""
        w = self.windows[group]
        return 0 if w is None else max(position - w + 1, 0) // self.page_size

    # ---- allocation ----
    def match_prefix(self, token_ids: list[int], cache_salt: str | None = None,
                     lora_id: int | None = None) -> PrefixHit:
        """The cached pages holding the longest cached prefix of `token_ids` under `cache_salt` and
        LoRA adapter `lora_id`: full pages, then the longest partial page that follows on, leaving
        at least the last token uncovered so a prompt always has a token to compute (with sliding
        groups: shrunk until each group holds what it reads, see the module docstring)."""
        if not self.enable_prefix_caching:
            return NO_HIT
        keys, parent, ps = [], root_key(cache_salt, lora_id), self.page_size
        full = [c for c, w in zip(self.group_cached, self.windows) if w is None]
        for i in range((len(token_ids) - 1) // ps):
            key = page_key(parent, token_ids[i * ps:(i + 1) * ps])
            if full and any(key not in c for c in full):
                break   # (no full group: every key, _full_hit finds the sliding groups' runs)
            keys.append(key)
            parent = key
        start = len(keys) * ps
        for n in range(min(len(token_ids) - 1 - start, ps - 1), 0, -1):
            key = page_key(parent, token_ids[start:start + n])
            if all(key in c for c in self.group_cached) and self._holds_window(keys, len(keys), start + n):
                hit = self._hit(keys, len(keys), start + n)
                return hit._replace(pages=hit.pages + [self.cached_page[key]], group_pages=tuple(
                    t + [c[key]] for t, c in zip(hit.group_pages, self.group_cached[1:])))
        return self._full_hit(keys)

    def _holds_window(self, keys: list[bytes], n: int, num_tokens: int) -> bool:
        """Whether each group caches those of its first n pages a query at num_tokens reads."""
        return all(keys[i] in c for g, c in enumerate(self.group_cached) for i in range(self._first_needed(g, num_tokens), n))

    def _full_hit(self, keys: list[bytes]) -> PrefixHit:
        """The longest hit of whole pages among `keys` (each cached in every full group) that every
        sliding group covers: each sliding group is searched from the right for the largest hit
        whose window pages it caches, until all agree."""
        n, settled = len(keys), False
        while not settled:
            settled = True
            for g, cached in enumerate(self.group_cached):
                while n and (miss := next((i for i in range(n - 1, self._first_needed(g, n * self.page_size) - 1, -1)
                                           if keys[i] not in cached), None)) is not None:
                    n, settled = miss, False   # a hit past an uncached page would read it
        return self._hit(keys, n, n * self.page_size)

    def _hit(self, keys: list[bytes], n: int, num_tokens: int) -> PrefixHit:
        """The hit of keys[:n] read from position num_tokens: each group's cached pages, NULL_PAGE
        before a sliding group's window."""
        tables = [[NULL_PAGE] * (lo := self._first_needed(g, num_tokens)) + [c[k] for k in keys[lo:n]]
                  for g, c in enumerate(self.group_cached)]
        return PrefixHit(tables[0], keys[:n], num_tokens, tuple(tables[1:]))

    def admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Give a sequence with no pages the prefix-cache pages `hit` (from match_prefix) plus fresh
        pages for `num_new_tokens` more tokens, and set num_computed_tokens past the hit. False (and
        nothing changed) when the pool is short of pages. A partial page among the hit is shared
        as it is: `reserve` copies it before the sequence writes into it, so it is left out when
        the pool has no page for that copy."""
        assert not seq.page_table, "admit expects a sequence without pages"
        computed, keys = hit.num_tokens, hit.keys   # each group's pages:
        tables = [hit.pages, *(hit.group_pages or [[] for _ in self.windows[1:]])]
        new = sum(self.pages_for(computed + num_new_tokens) - len(t) for t in tables)
        pages = [p for t in tables for p in t if self._real(p)]
        reclaimed = sum(1 for p in pages if self.ref_counts[p] == 0)    # evictable hits leave the pool
        if len(hit.pages) > len(keys) and new + len(tables) > self.num_free_pages - reclaimed:
            return self.admit(seq, self._full_hit(keys), num_new_tokens)
        if new > self.num_free_pages - reclaimed:
            return False
        for p in pages:
            self._incref(p)
        end = self.pages_for(computed + num_new_tokens)
        seq.page_table, *seq.group_tables = (PageTable(list(t) + [self._take_page() for _ in range(end - len(t))])
                                             for t in tables)
        seq.page_hashes = list(keys)
        seq.num_computed_tokens = computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = computed
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += computed
        return True

    def fork(self, src: Sequence, dst: Sequence, num_tokens: int) -> bool:
        """Let `dst` share the pages holding `src`'s first num_tokens tokens (same token ids). False
        (nothing changed) when src released pages of a sliding window that dst's next token reads."""
        assert not dst.page_table and src.num_computed_tokens >= num_tokens
        tables = [t[:self.pages_for(num_tokens)] for t in src.page_tables]
        if any(NULL_PAGE in t[self._first_needed(g, num_tokens):] for g, t in enumerate(tables) if self.windows[g]):
            return False
        dst.page_table, *dst.group_tables = (PageTable(t) for t in tables)
        for p in filter(self._real, (p for t in tables for p in t)):
            self._incref(p)
        dst.page_hashes = src.page_hashes[:num_tokens // self.page_size]
        dst.num_computed_tokens = num_tokens
        return True

    def reserve(self, seq: Sequence, num_tokens_ahead: int) -> list[tuple[int, int]] | None:
        """Make seq's page tables cover num_computed_tokens + num_tokens_ahead tokens (known or
        proposed), replacing every page this step writes into that is shared or cached by a private
        copy. Returns the (src, dst) page copies, or None (nothing changed but the release of pages
        out of a sliding window, which holds whatever comes) when the pool is short."""
        start, ps = seq.num_computed_tokens, self.page_size
        self._release_out_of_window(seq, start)
        end_page = self.pages_for(start + num_tokens_ahead)
        plans = []   # per table: the entries it writes that are shared, and its new pages
        for table in seq.page_tables:
            written = range(start // ps, min(end_page, len(table)))
            plans.append(([i for i in written if self.ref_counts[table[i]] > 1 or table[i] in self.page_key],
                          max(end_page - len(table), 0)))
        need = sum(len(shared) + new for shared, new in plans)
        if not need:
            return []   # most decode steps: the token goes into the sequence's own last pages
        if need > self.num_free_pages:
            return None
        copies, released = [], []
        for table, (shared, new) in zip(seq.page_tables, plans):
            for i in shared:
                copies.append((table[i], self._take_page()))
                released.append(table[i])
                table[i] = copies[-1][1]
            table.extend(self._take_page() for _ in range(new))
        for src in released:
            self._decref(src)               # after all takes, so no src is reused in this call
        return copies

    def _release_out_of_window(self, seq: Sequence, start: int) -> None:
        """Release each sliding table's pages wholly before its window of a query at `start`."""
        for g, table in enumerate(seq.page_tables):
            for i in range(min(self._first_needed(g, start), len(table)) - 1, -1, -1):
                if table[i] == NULL_PAGE:
                    break   # released ones are a prefix
                self._decref(table[i])
                table[i] = NULL_PAGE

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the K/V of seq's last num_tokens computed tokens (see the module docstring)."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_computed_tokens} computed tokens")
        seq.num_computed_tokens -= num_tokens
        keep = self.pages_for(seq.num_computed_tokens)
        for table in seq.page_tables:
            self._drop(table[keep:])
            del table[keep:]
        del seq.page_hashes[seq.num_computed_tokens // self.page_size:]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; tail pages first, so they are evicted before the shared
        head of a prefix. A last page partly filled with computed, known tokens is cached (see
        Partial pages in the module docstring)."""
        self._cache_partial_page(seq)
        for table in seq.page_tables:
            self._drop(table)
        seq.page_table, seq.group_tables = PageTable(), []
        seq.page_hashes = []

    def cache_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full pages among the sequence's first num_tokens tokens in the prefix cache
        (call when a step that computed them is done: a later step may still be running), in every
        group that still holds them."""
        if not self.enable_prefix_caching:
            return
        assert num_tokens <= seq.num_computed_tokens, "registering tokens not computed (roll back rejected proposals first)"
        ps = self.page_size
        num_full = num_tokens // ps
        if num_full <= len(seq.page_hashes):
            return
        first = len(seq.page_hashes)
        tokens = seq.token_range(first * ps, num_full * ps)   # not the whole token list, each page
        for i in range(first, num_full):
            parent = seq.page_hashes[-1] if seq.page_hashes else root_key(seq.sampling.cache_salt, seq.lora_id)
            key = page_key(parent, tokens[(i - first) * ps:(i - first + 1) * ps])
            seq.page_hashes.append(key)
            for g, table in enumerate(seq.page_tables):
                self._register(g, key, table[i])

    def _register(self, group: int, key: bytes, page: int) -> None:
        # The same prefix may already be cached in another page (computed concurrently): keep that one.
        cached = self.group_cached[group]
        if self._real(page) and key not in cached and page not in self.page_key:
            cached[key] = page
            self.page_key[page] = key
            self.page_group[page] = group

    def _cache_partial_page(self, seq: Sequence) -> None:
        ps = self.page_size
        known = min(seq.num_computed_tokens, seq.num_prompt_tokens + seq.num_known_outputs)
        full, n = divmod(known, ps)
        if not (self.enable_prefix_caching and n and len(seq.page_hashes) >= full and len(seq.page_table) > full):
            return
        parent = seq.page_hashes[full - 1] if full else root_key(seq.sampling.cache_salt, seq.lora_id)
        key = page_key(parent, seq.token_range(full * ps, known))
        for g, table in enumerate(seq.page_tables):
            # Not a page others still hold (a fork's): they may write into it, as a cached page never is.
            if self.ref_counts[table[full]] == 1:
                self._register(g, key, table[full])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page (as vLLM's: after new weights, or to benchmark cold); False,
        and nothing forgotten, while any page is in use (its sequence's keys would outlive it)."""
        if any(self.ref_counts):
            return False
        for page in self.evictable:
            self.free_pages.append(page)
            self._stale(page)
        self.evictable.clear()
        for mapping in (*self.group_cached, self.page_key, self.page_group):
            mapping.clear()
        return True

    def drain_stale_pages(self) -> list[int]:
        """The stale pages recorded since the last call (see the module docstring), each once."""
        pages = sorted(set(self.stale_pages))
        self.stale_pages.clear()
        return pages

    # ---- internals ----
    def _real(self, page: int) -> bool:
        """Not the NULL_PAGE of released entries (page 0 is a real one without sliding groups)."""
        return page != NULL_PAGE or not self.reserved

    def _drop(self, pages: list[int]) -> None:
        """Drop one reference to each page, the last first (NULL_PAGE entries hold none)."""
        for p in filter(self._real, reversed(pages)):
            self._decref(p)

    def _incref(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.evictable[page]
        self.ref_counts[page] += 1

    def _decref(self, page: int) -> None:
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if page in self.page_key:
                self.evictable[page] = None
            else:
                self.free_pages.append(page)
                self._stale(page)

    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)    # least recently released
            del self.group_cached[self.page_group.pop(page)][self.page_key.pop(page)]
        self.ref_counts[page] = 1
        self._stale(page)
        return page

    def _stale(self, page: int) -> None:
        if self.stale_pages is not None:
            self.stale_pages.append(page)
