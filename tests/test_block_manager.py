"""BlockManager invariants, checked against a model of the page pool's contents.

The model stores, for every slot, the token whose K/V a real runner would have written there
(copy-on-write copies applied first). A sequence is correct when reading its page table back
gives its own token ids, so a wrong prefix hit, a shared page written in place or an evicted
page still in use all show up as a mismatch.
"""
import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxserve.block_manager import BlockManager
from jaxserve.sampling_params import SamplingParams
from jaxserve.sequence import Sequence

PS = 4
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]


def seq_of(tokens, rid="r", salt=None):
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), sampling=SamplingParams(cache_salt=salt))


class PagePool:
    """Slot contents of a pool of pages: what a runner would have written."""

    def __init__(self, bm):
        self.bm = bm
        self.slots = [None] * (bm.num_pages * bm.page_size)

    def copy(self, copies):
        ps = self.bm.page_size
        data = [self.slots[src * ps:(src + 1) * ps] for src, _ in copies]    # read all, then write
        for (_, dst), page in zip(copies, data):
            self.slots[dst * ps:(dst + 1) * ps] = page

    def compute(self, seq, n, proposed=()):
        """Write K/V of seq's next n tokens (known, then proposed); copy-on-write must have left no
        shared page to write."""
        ps = self.bm.page_size
        tokens = seq.token_ids + list(proposed)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            page = seq.page_table[p // ps]
            assert self.bm.ref_counts[page] == 1, f"writing into shared page {page}"
            assert page not in self.bm.page_key, f"writing into cached page {page}"
            self.slots[page * ps + p % ps] = tokens[p]
        seq.num_computed_tokens += n
        if not proposed:
            self.bm.cache_full_pages(seq, seq.num_computed_tokens)

    def read(self, page_table, num_tokens):
        ps = self.bm.page_size
        return [self.slots[page_table[p // ps] * ps + p % ps] for p in range(num_tokens)]


def paged(num_pages, **kw):
    """A BlockManager of num_pages pages of PS tokens, and its PagePool."""
    bm = BlockManager(num_pages, PS, **kw)
    return bm, PagePool(bm)


def snapshot(bm):
    return (list(bm.ref_counts), list(bm.free_pages), list(bm.evictable), dict(bm.cached_page))


class SequenceMachine(RuleBasedStateMachine):
    """Admit, extend and verify rules over self.bm, self.pool and self.live (a subclass sets them up
    in its @initialize), with hooks for what a machine checks beyond them."""
    max_tail = 6              # the most tokens added after a base prompt's cut
    verify_from_known = False  # a verify row starts at a known token (one is sampled when none is left)

    unallocated = frozenset()  # pages no sequence is given (a table entry of one holds no reference)

    def tables_of(self, seq):
        return [seq.page_table]

    def snapshot(self):
        """What a reserve or admit that fails must leave unchanged."""
        return snapshot(self.bm)

    def check_hit(self, seq, hit):
        assert hit == self.bm.match_prefix(seq.token_ids)          # same tokens, same pages
        assert self.pool.read(hit.pages, hit.num_tokens) == seq.token_ids[:hit.num_tokens]

    def after_reserve(self, seq, start):
        """Checks right after a reserve for a step from `start` (successful or not)."""

    def reserve(self, seq, n):
        """self.bm.reserve(seq, n), checked (after_reserve; a failed one changes nothing), its copies applied."""
        start, before = seq.num_computed_tokens, self.snapshot()
        copies = self.bm.reserve(seq, n)
        self.after_reserve(seq, start)
        assert copies is not None or self.snapshot() == before
        self.pool.copy(copies or [])
        return copies

    @rule(data=st.data(), base=st.sampled_from(BASES), cut=st.integers(1, 12), chunk=st.integers(1, 16))
    def admit(self, data, base, cut, chunk):
        seq = seq_of(base[:cut] + data.draw(st.lists(st.integers(0, 3), max_size=self.max_tail)))
        hit = self.bm.match_prefix(seq.token_ids)
        assert hit.num_tokens < seq.num_tokens                     # the last token is left to compute
        self.check_hit(seq, hit)
        n = min(chunk, seq.num_tokens - hit.num_tokens)
        before = self.snapshot()
        if not self.bm.admit(seq, hit, n):
            assert self.snapshot() == before
            return
        # (a partial page is left out of the hit when the pool has no page for its copy)
        assert seq.num_computed_tokens in (hit.num_tokens, len(hit.keys) * PS)
        copies = self.reserve(seq, n)   # as the scheduler: a partial page hit is copied first
        assert copies is not None       # admit left room for the copy
        self.pool.compute(seq, n)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 9), new=st.lists(st.integers(0, 3), min_size=1, max_size=3))
    def extend(self, data, n, new):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids += new                            # as if sampled
        n = min(n, seq.num_tokens - seq.num_computed_tokens)
        copies = self.reserve(seq, n)
        if copies is None:
            return
        for src, dst in copies:    # the source stays with its other holders or in the prefix cache
            assert self.bm.ref_counts[src] >= 1 or src in self.bm.evictable
            assert self.bm.ref_counts[dst] == 1 and dst not in self.bm.page_key
        assert len({dst for _, dst in copies}) == len(copies)
        assert len(seq.page_table) == self.bm.pages_for(seq.num_computed_tokens + n)
        self.pool.compute(seq, n)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), proposed=st.lists(st.integers(0, 3), min_size=1, max_size=6), bonus=st.integers(0, 3))
    def verify(self, data, proposed, bonus):
        """A verify row: reserve and write the known tokens left and k proposals, accept a prefix
        of the proposals and a token after it, roll the rest back, then cache full pages."""
        seq = data.draw(st.sampled_from(self.live))
        if self.verify_from_known and seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(bonus)   # a verify row's first token is its last known one
        known = seq.num_tokens - seq.num_computed_tokens
        start = seq.num_computed_tokens
        copies = self.reserve(seq, known + len(proposed))
        if copies is None:
            return
        assert len(seq.page_table) == self.bm.pages_for(seq.num_tokens + len(proposed))
        self.pool.compute(seq, known + len(proposed), proposed)
        accepted = data.draw(st.integers(0, len(proposed)))
        seq.output_token_ids += proposed[:accepted] + [bonus]
        self.rollback_and_check(seq, len(proposed) - accepted)
        assert seq.num_computed_tokens > start or not known   # never before the step's first query position
        self.bm.cache_full_pages(seq, seq.num_computed_tokens)

    def can_fork(self, src, k):
        """The oracle: whether src still holds every page a child of its first k tokens reads."""
        return True

    @precondition(lambda self: any(s.num_computed_tokens for s in self.live))
    @rule(data=st.data(), tail=st.lists(st.integers(0, 3), max_size=3))
    def fork(self, data, tail):
        src = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens]))
        k = data.draw(st.integers(1, src.num_computed_tokens))
        child = seq_of(src.token_ids[:k] + tail + [0])
        can = self.can_fork(src, k)
        assert self.bm.fork(src, child, k) == can
        if can:
            self.live.append(child)

    @invariant()
    def refcounts_match_page_tables(self):
        refs = [0] * self.bm.num_pages
        for s in self.live:
            for table in self.tables_of(s):
                for p in table:
                    refs[p] += p not in self.unallocated
        assert refs == self.bm.ref_counts

    @invariant()
    def every_page_in_exactly_one_state(self):
        bm = self.bm
        free, cached = set(bm.free_pages), set(bm.evictable)
        used = {p for p in range(bm.num_pages) if bm.ref_counts[p] > 0}
        assert len(free) == len(bm.free_pages) and len(cached) == len(bm.evictable)
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert not (self.unallocated & (free | cached | used))
        assert len(free) + len(used) + len(cached) == bm.num_pages - len(self.unallocated)
        assert bm.num_free_pages + bm.num_used_pages == bm.num_pages - len(self.unallocated)
        assert cached <= set(bm.page_key) and not (free & set(bm.page_key))

    def rollback_and_check(self, seq, num_tokens):
        end = seq.num_computed_tokens - num_tokens
        pages = self.bm.pages_for(end)
        dropped = seq.page_table[pages:]
        self.bm.rollback(seq, num_tokens)
        assert seq.num_computed_tokens == end and len(seq.page_table) == pages
        assert len(seq.page_hashes) <= end // PS
        others = [p for s in self.live for p in s.page_table]
        for p in dropped:   # released unless another sequence holds it
            assert self.bm.ref_counts[p] == others.count(p)


class BlockManagerMachine(SequenceMachine):
    @initialize(num_pages=st.integers(4, 24), caching=st.booleans())
    def setup(self, num_pages, caching):
        self.bm, self.pool = paged(num_pages, enable_prefix_caching=caching)
        self.live = []
        self.prefix_of_key = {}   # every key ever registered -> the token prefix it names

    @precondition(lambda self: any(s.num_computed_tokens for s in self.live))
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), max_size=3))
    def rollback(self, data, new):
        """Roll back any number of computed tokens; outputs past the new end may then change."""
        seq = data.draw(st.sampled_from([s for s in self.live if s.num_computed_tokens]))
        self.rollback_and_check(seq, data.draw(st.integers(1, seq.num_computed_tokens)))
        keep = max(seq.num_computed_tokens, seq.num_prompt_tokens) - seq.num_prompt_tokens
        if new:
            seq.output_token_ids = seq.output_token_ids[:keep] + new

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        keys = set(self.bm.cached_page)
        self.bm.free(seq)
        for key in set(self.bm.cached_page) - keys:   # its partial last page
            assert len(key_pages := [k for k in self.bm.cached_page if k not in keys]) == 1, key_pages
            self.prefix_of_key.setdefault(key, seq.token_ids[:seq.num_computed_tokens])
        self.live.remove(seq)
        assert seq.page_table == []

    @invariant()
    def cached_pages_keyed_both_ways(self):
        assert {self.bm.cached_page[k]: k for k in self.bm.cached_page} == self.bm.page_key

    @invariant()
    def sequences_read_back_their_tokens(self):
        for s in self.live:
            assert len(s.page_table) >= self.bm.pages_for(s.num_computed_tokens)
            assert self.pool.read(s.page_table, s.num_computed_tokens) == s.token_ids[:s.num_computed_tokens]

    @invariant()
    def cached_pages_hold_their_prefix(self):
        for s in self.live:
            for i, key in enumerate(s.page_hashes):
                self.prefix_of_key.setdefault(key, s.token_ids[:(i + 1) * PS])
        for key, page in self.bm.cached_page.items():
            prefix = self.prefix_of_key[key]
            n = len(prefix) % PS or PS   # a partial page's tokens, or a full page's
            assert self.pool.read([page], n) == prefix[-n:]


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase


def computed(bm, pool, tokens, rid="r", salt=None):
    """The sequence of a prompt admitted under cache salt `salt` and fully computed (a partial hit copied first)."""
    seq = seq_of(tokens, rid, salt)
    hit = bm.match_prefix(seq.token_ids, salt)
    assert bm.admit(seq, hit, seq.num_tokens - hit.num_tokens)
    pool.copy(bm.reserve(seq, seq.num_tokens - hit.num_tokens))
    pool.compute(seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


def test_prefix_hit_reuses_pages_and_counts_hit_rate():
    bm, pool = paged(8)
    a = computed(bm, pool, range(10))                 # pages 0, 1 full, page 2 partial
    b = seq_of(list(range(8)) + [50, 51])
    hit = bm.match_prefix(b.token_ids)
    assert hit[0] == a.page_table[:2]
    assert bm.admit(b, hit, 2)
    assert b.num_computed_tokens == 8 and bm.ref_counts[a.page_table[0]] == 2
    assert bm.prefix_hit_rate == 8 / 20
    # A prompt that is exactly the cached pages still leaves its last token to compute.
    assert len(bm.match_prefix(list(range(8)))[0]) == 1


def test_unreferenced_cached_pages_are_evicted_lru_and_only_when_needed():
    bm, pool = paged(4)
    a = computed(bm, pool, range(9))                  # 2 full pages + 1 token (a partial page)
    a_pages = list(a.page_table)
    bm.free(a)
    assert bm.num_cached_pages == 3 and bm.num_free_pages == 4
    # Tail pages are released first, so the partial page, then the second page of the prefix, are evicted first.
    c = computed(bm, pool, [90] * 9)                  # takes the free page, then evicts two cached
    assert a_pages[1] in c.page_table and a_pages[0] not in c.page_table
    hit = bm.match_prefix(list(range(9)))
    assert hit[0] == a_pages[:1]


def test_a_prompt_going_on_from_an_ended_sequence_shares_its_partial_page():
    """A sequence that ends inside a page leaves it cached under the tokens it holds: a prompt that
    goes on from there (a conversation's next turn, a beam search round) computes only the tokens
    after them, into a copy of the page; one that differs inside the page gets the full pages."""
    bm, pool = paged(8)
    a = computed(bm, pool, range(10))                 # 2 full pages + 2 tokens
    a_pages = list(a.page_table)
    bm.free(a)
    b = seq_of(list(range(10)) + [50, 51])
    hit = bm.match_prefix(b.token_ids)
    assert (hit.pages, hit.num_tokens) == (a_pages, 10)
    assert bm.admit(b, hit, 2) and b.num_computed_tokens == 10 == b.num_cached_tokens
    copies = bm.reserve(b, 2)
    assert copies == [(a_pages[2], b.page_table[2])] and b.page_table[2] != a_pages[2]
    pool.copy(copies)
    pool.compute(b, 2)
    assert pool.read(b.page_table, 12) == b.token_ids and pool.read(a_pages[2:], 2) == [8, 9]
    assert bm.match_prefix(list(range(10)) + [7]).num_tokens == 10          # a's page again
    assert bm.match_prefix(list(range(9)) + [77, 1])[:3] == (a_pages[:2], b.page_hashes[:2], 8)
    assert bm.match_prefix(list(range(10))).num_tokens == 8   # [8, 9] would leave no token to compute


def test_a_page_a_fork_still_holds_is_not_cached_when_its_sibling_ends():
    """A partial page is cached only when the ended sequence was its one holder: a running fork
    sibling writes on into it (its own, not a copy)."""
    bm, pool = paged(8)
    parent = computed(bm, pool, range(6))             # pages [x, y], y half full
    child = seq_of(list(range(6)) + [1])
    bm.fork(parent, child, 6)
    bm.free(child)
    assert parent.page_table[1] not in bm.page_key and bm.match_prefix(list(range(7))).num_tokens == 4
    parent.output_token_ids.append(9)
    assert bm.reserve(parent, 1) == []
    pool.compute(parent, 1)


def test_a_partial_hit_is_left_out_when_the_pool_has_no_page_for_its_copy():
    """One page: the page a cached partial hit would be copied into is the page itself, so the
    prompt is admitted without the hit and computes from its start (else it would wait forever)."""
    bm = BlockManager(1, 2)
    a = seq_of([1])
    assert bm.admit(a, bm.match_prefix(a.token_ids), 1)
    a.num_computed_tokens = 1
    bm.free(a)                                        # page 0 cached, holding [1]
    b = seq_of([1, 1])
    hit = bm.match_prefix(b.token_ids)
    assert (hit.pages, hit.num_tokens) == ([0], 1)
    assert bm.admit(b, hit, 1) and b.num_computed_tokens == 0 and b.page_table == [0]
    assert bm.reserve(b, 1) == [] and 0 not in bm.page_key


def test_cow_copy_gives_private_page_to_the_writer():
    bm, pool = paged(6)
    parent = computed(bm, pool, range(6))             # pages [x, y], y half full
    child = seq_of(list(range(6)) + [1])
    bm.fork(parent, child, 6)
    assert child.page_table == parent.page_table
    copies = bm.reserve(child, 1)
    assert copies == [(parent.page_table[1], child.page_table[1])] and parent.page_table[1] != child.page_table[1]
    pool.copy(copies)
    pool.compute(child, 1)
    assert pool.read(parent.page_table, 6) == list(range(6))
    assert pool.read(child.page_table, 7) == list(range(6)) + [1]


def test_rollback_releases_tail_pages_and_keeps_cached_pages_correct():
    bm, pool = paged(8)
    a = computed(bm, pool, range(10))                 # pages 0, 1 full and cached, page 2 partial
    child = seq_of(list(range(10)) + [1])
    bm.fork(a, child, 10)
    full = list(a.page_table[:2])
    bm.rollback(a, 7)                                 # back into the first page
    assert a.num_computed_tokens == 3 and a.page_table == full[:1] and a.page_hashes == []
    assert [bm.ref_counts[p] for p in child.page_table] == [2, 1, 1]   # the child still holds them all
    assert bm.match_prefix(list(range(9)))[0] == full  # both pages still name their prefix
    a.prompt_token_ids = [0, 1, 2, 30, 31, 32, 33, 34, 35]               # new tokens past the new end
    copies = bm.reserve(a, 6)
    assert copies == [(full[0], a.page_table[0])]    # the cached page is copied, not rewritten
    pool.copy(copies)
    pool.compute(a, 6)
    assert pool.read(full, 8) == list(range(8)) and pool.read(child.page_table, 10) == list(range(10))
    assert bm.match_prefix(a.token_ids + [0])[0] == a.page_table[:2] != full
    bm.free(child)
    bm.rollback(a, a.num_computed_tokens)
    assert a.page_table == [] and bm.num_used_pages == 0


def test_reserve_fails_without_changes_when_pool_is_short():
    bm, pool = paged(2, enable_prefix_caching=False)
    a = computed(bm, pool, range(8))
    before = snapshot(bm)
    assert bm.reserve(a, 1) is None and snapshot(bm) == before


def test_cache_salts_never_share_pages():
    """Equal prompts under different salts (tenants) neither hit each other's pages nor share one;
    under the same salt they do."""
    bm, pool = paged(16)
    tokens = list(range(13))                          # 3 full pages + 1
    seqs = {salt: computed(bm, pool, tokens, salt or "none", salt) for salt in ("tenant-a", "tenant-b", None)}
    assert [s.num_cached_tokens for s in seqs.values()] == [0, 0, 0]
    for a in seqs.values():
        for b in seqs.values():
            assert a is b or not set(a.page_table) & set(b.page_table)
    again = computed(bm, pool, tokens, "a2", "tenant-a")
    assert again.num_cached_tokens == 12 and again.page_table[:3] == seqs["tenant-a"].page_table[:3]
    for seq in [*seqs.values(), again]:
        assert pool.read(seq.page_table, seq.num_tokens) == tokens
    for salt in ("tenant-c", "", None):
        assert bm.match_prefix(tokens, salt)[0] != seqs["tenant-a"].page_table[:3]
