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
"""
from __future__ import annotations

import collections
import hashlib
import json
from array import array

from typing import NamedTuple

from jaxserve.sequence import PageTable, Sequence


def page_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_key(cache_salt: str | None, lora_id: int | None = None) -> bytes:
    """The parent key of a sequence's first page (b"": no salt, the base model)."""
    if cache_salt is None and lora_id is None:
        return b""
    return hashlib.sha256(json.dumps(["salt", cache_salt, lora_id]).encode()).digest()


class PrefixHit(NamedTuple):
    """Cached pages holding a prompt's first `num_tokens` tokens, and the keys of the full ones (the
    last page may be a partial one, without a key here)."""
    pages: list[int]
    keys: list[bytes]
    num_tokens: int


NO_HIT = PrefixHit([], [], 0)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 track_stale_pages: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.free_pages = collections.deque(range(num_pages))
        self.cached_page = {}                                   # key -> page
        self.page_key = {}                                      # page -> key, for pages in cached_page
        self.evictable = collections.OrderedDict()              # unreferenced cached pages, LRU first
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
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
        return self.num_pages - self.num_free_pages

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocation ----
    def match_prefix(self, token_ids: list[int], cache_salt: str | None = None,
                     lora_id: int | None = None) -> PrefixHit:
        """The cached pages holding the longest cached prefix of `token_ids` under `cache_salt` and
        LoRA adapter `lora_id`: full pages, then the longest partial page that follows on, leaving
        at least the last token uncovered so a prompt always has a token to compute."""
        pages, keys, parent = [], [], root_key(cache_salt, lora_id)
        if not self.enable_prefix_caching:
            return NO_HIT
        ps = self.page_size
        for i in range((len(token_ids) - 1) // ps):
            key = page_key(parent, token_ids[i * ps:(i + 1) * ps])
            page = self.cached_page.get(key)
            if page is None:
                break
            pages.append(page)
            keys.append(key)
            parent = key
        start = len(keys) * ps
        for n in range(min(len(token_ids) - 1 - start, ps - 1), 0, -1):
            page = self.cached_page.get(page_key(parent, token_ids[start:start + n]))
            if page is not None:
                return PrefixHit(pages + [page], keys, start + n)
        return PrefixHit(pages, keys, start)

    def admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Give a sequence with no pages the prefix-cache pages `hit` (from match_prefix) plus fresh
        pages for `num_new_tokens` more tokens, and set num_computed_tokens past the hit. False (and
        nothing changed) when the pool is short of pages. A partial page among the hit is shared
        as it is: `reserve` copies it before the sequence writes into it, so it is left out when
        the pool has no page for that copy."""
        assert not seq.page_table, "admit expects a sequence without pages"
        pages, keys, computed = hit
        new = self.pages_for(computed + num_new_tokens) - len(pages)
        reclaimed = sum(1 for p in pages if self.ref_counts[p] == 0)    # evictable hits leave the pool
        if len(pages) > len(keys) and new + 1 > self.num_free_pages - reclaimed:
            return self.admit(seq, PrefixHit(pages[:-1], keys, len(keys) * self.page_size), num_new_tokens)
        if new > self.num_free_pages - reclaimed:
            return False
        for p in pages:
            self._incref(p)
        seq.page_table = PageTable(list(pages) + [self._take_page() for _ in range(new)])
        seq.page_hashes = list(keys)
        seq.num_computed_tokens = computed
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = computed
        if self.enable_prefix_caching:
            self.prefix_queried_tokens += seq.num_tokens
            self.prefix_hit_tokens += computed
        return True

    def fork(self, src: Sequence, dst: Sequence, num_tokens: int) -> None:
        """Let `dst` share the pages holding `src`'s first num_tokens tokens (same token ids)."""
        assert not dst.page_table and src.num_computed_tokens >= num_tokens
        dst.page_table = PageTable(src.page_table[:self.pages_for(num_tokens)])
        for p in dst.page_table:
            self._incref(p)
        dst.page_hashes = src.page_hashes[:num_tokens // self.page_size]
        dst.num_computed_tokens = num_tokens

    def reserve(self, seq: Sequence, num_tokens_ahead: int) -> list[tuple[int, int]] | None:
        """Make seq's page table cover num_computed_tokens + num_tokens_ahead tokens (known or
        proposed), replacing every page this step writes into that is shared or cached by a private
        copy. Returns the (src, dst) page copies, or None (nothing changed) when the pool is short."""
        start, table = seq.num_computed_tokens, seq.page_table
        end_page = self.pages_for(start + num_tokens_ahead)
        written = range(start // self.page_size, min(end_page, len(table)))
        shared = [i for i in written if self.ref_counts[table[i]] > 1 or table[i] in self.page_key]
        new = end_page - len(table)
        if not shared and new <= 0:
            return []   # most decode steps: the token goes into the sequence's own last page
        if len(shared) + max(new, 0) > self.num_free_pages:
            return None
        copies = [(table[i], self._take_page()) for i in shared]
        table.extend(self._take_page() for _ in range(new))
        for i, (src, dst) in zip(shared, copies):
            table[i] = dst
            self._decref(src)               # after all takes, so no src is reused in this call
        return copies

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the K/V of seq's last num_tokens computed tokens (see the module docstring)."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {seq.num_computed_tokens} computed tokens")
        seq.num_computed_tokens -= num_tokens
        keep = self.pages_for(seq.num_computed_tokens)
        for p in reversed(seq.page_table[keep:]):
            self._decref(p)
        del seq.page_table[keep:]
        del seq.page_hashes[seq.num_computed_tokens // self.page_size:]

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; tail pages first, so they are evicted before the shared
        head of a prefix. A last page partly filled with computed, known tokens is cached (see
        Partial pages in the module docstring)."""
        self._cache_partial_page(seq)
        for p in reversed(seq.page_table):
            self._decref(p)
        seq.page_table = PageTable()
        seq.page_hashes = []

    def cache_full_pages(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full pages among the sequence's first num_tokens tokens in the prefix cache
        (call when a step that computed them is done: a later step may still be running)."""
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
            page = seq.page_table[i]
            # The same prefix may already be cached in another page (computed concurrently): keep that one.
            if key not in self.cached_page and page not in self.page_key:
                self.cached_page[key] = page
                self.page_key[page] = key

    def _cache_partial_page(self, seq: Sequence) -> None:
        ps = self.page_size
        known = min(seq.num_computed_tokens, seq.num_prompt_tokens + seq.num_known_outputs)
        full, n = divmod(known, ps)
        if not (self.enable_prefix_caching and n and len(seq.page_hashes) >= full and len(seq.page_table) > full):
            return
        parent = seq.page_hashes[full - 1] if full else root_key(seq.sampling.cache_salt, seq.lora_id)
        key, page = page_key(parent, seq.token_range(full * ps, known)), seq.page_table[full]
        # Not a page others still hold (a fork's): they may write into it, as a cached page never is.
        if self.ref_counts[page] == 1 and key not in self.cached_page and page not in self.page_key:
            self.cached_page[key] = page
            self.page_key[page] = key

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page (as vLLM's: after new weights, or to benchmark cold); False,
        and nothing forgotten, while any page is in use (its sequence's keys would outlive it)."""
        if any(self.ref_counts):
            return False
        for page in self.evictable:
            self.free_pages.append(page)
            self._stale(page)
        self.evictable.clear()
        self.cached_page.clear()
        self.page_key.clear()
        return True

    def drain_stale_pages(self) -> list[int]:
        """The stale pages recorded since the last call (see the module docstring), each once."""
        pages = sorted(set(self.stale_pages))
        self.stale_pages.clear()
        return pages

    # ---- internals ----
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
            del self.cached_page[self.page_key.pop(page)]
        self.ref_counts[page] = 1
        self._stale(page)
        return page

    def _stale(self, page: int) -> None:
        if self.stale_pages is not None:
            self.stale_pages.append(page)
