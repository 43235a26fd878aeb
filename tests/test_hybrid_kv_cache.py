"""The hybrid KV cache (jaxserve/kv_groups.py): sliding-window layers keep only their window's pages.

Block manager: a state machine over sequences with a full group and sliding groups, checked
against a plain-Python oracle of which pages each group must hold (a sliding group: those from
the page of position start - w + 1, start the latest step's first query position), of what the
pages hold (a model of the pool's slots, as tests/test_block_manager.py's), and of the longest
prefix hit every group can serve (brute force over the cached keys). Engine: greedy tokens of
seeded gpt-oss and Mistral checkpoints with an 8-token window and 4-token pages, with the hybrid
cache on and off, equal to transformers' through chunked prefill, a prefix hit, preemption, n > 1,
n-gram speculation, a draft model (its pool addressed by the full group's page table), multi-step
decodes, sleep and wake-up, and sequence-parallel prefill with tensor parallelism, with freed
pages poisoned (NaN) so a released page read shows up; the hybrid run holds fewer pages.
"""
import functools
import json
import os
import subprocess
import sys

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule

from jaxserve.block_manager import BlockManager, page_key, root_key, sequence_pages
from jaxserve.kv_groups import NULL_PAGE, KVGroups
from tests.test_block_manager import PS, PagePool, SequenceMachine, seq_of

LAYOUTS = {"full+sliding": (None, 6, 9), "sliding": (5,)}


def groups_of(windows):
    return KVGroups(tuple(windows), (), (), 1)


def first_needed(window, position):
    """Oracle: the first page a query at `position` reads (all of them without a window)."""
    return 0 if window is None else max(position - window + 1, 0) // PS


class GroupPool(PagePool):
    """PagePool over every group's table: a step writes each token into each group's page."""

    def compute(self, seq, n, proposed=()):
        tokens = seq.token_ids + list(proposed)
        for table in seq.page_tables:
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                page = table[p // PS]
                assert page != NULL_PAGE and self.bm.ref_counts[page] == 1 and page not in self.bm.page_key
                self.slots[page * PS + p % PS] = tokens[p]
        seq.num_computed_tokens += n
        if not proposed:
            self.bm.cache_full_pages(seq, seq.num_computed_tokens)


def brute_force_hit(bm, token_ids):
    """Oracle: the most whole pages h of token_ids such that every full group caches pages 0..h-1
    and every sliding group the pages a query at h * PS reads."""
    keys, parent = [], root_key(None)
    for i in range((len(token_ids) - 1) // PS):
        parent = page_key(parent, token_ids[i * PS:(i + 1) * PS])
        keys.append(parent)
    for h in range(len(keys), -1, -1):
        if all(keys[i] in cached for w, cached in zip(bm.windows, bm.group_cached)
               for i in range(first_needed(w, h * PS), h)):
            return h
    return 0


class HybridMachine(SequenceMachine):
    """tests/test_block_manager.py's admit, extend and verify rules over groups; a sliding group's
    pages are released as a reserve's step moves on (even when it then fails for want of pages)."""
    max_tail = 12
    verify_from_known = True
    unallocated = frozenset({NULL_PAGE})

    def tables_of(self, seq):
        return seq.page_tables

    @initialize(num_pages=st.integers(8, 40), layout=st.sampled_from(sorted(LAYOUTS)))
    def setup(self, num_pages, layout):
        self.windows = LAYOUTS[layout]
        self.bm = BlockManager(num_pages, PS, groups=groups_of(self.windows))
        self.pool = GroupPool(self.bm)
        self.live = []

    def snapshot(self):
        """Nothing: a reserve that fails has still released out-of-window pages."""

    def check_hit(self, seq, hit):
        if hit.num_tokens % PS == 0:   # whole pages: the longest every group serves
            assert hit.num_tokens == brute_force_hit(self.bm, seq.token_ids) * PS
        for w, pages in zip(self.windows, [hit.pages, *hit.group_pages]):
            lo = first_needed(w, hit.num_tokens)
            assert NULL_PAGE not in pages[lo:] and set(pages[:lo]) <= {NULL_PAGE}
            assert self.pool.read(pages[lo:], len(pages[lo:]) * PS)[:hit.num_tokens - lo * PS] == \
                seq.token_ids[lo * PS:hit.num_tokens]

    def after_reserve(self, seq, start):
        self.check_released(seq, start)

    def check_released(self, seq, start):
        """Right after a reserve for a step from `start`: each sliding table holds exactly the
        pages from the one of position start - w + 1 on (the oracle), the rest NULL_PAGE."""
        for w, table in zip(self.windows, seq.page_tables):
            lo = first_needed(w, start)
            assert [i for i, p in enumerate(table) if p != NULL_PAGE] == list(range(lo, len(table)))

    def can_fork(self, src, k):
        """The oracle: src still holds every page the child's next token reads."""
        return all(NULL_PAGE not in t[first_needed(w, k):self.bm.pages_for(k)]
                   for w, t in zip(self.windows, src.page_tables) if w is not None)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))   # a finished or a preempted sequence
        self.bm.free(seq)
        self.live.remove(seq)
        assert not any(seq.page_tables)

    @invariant()
    def pages_in_one_group(self):
        """(and in one state: the shared invariant, with the NULL_PAGE in none)"""
        bm = self.bm
        owner = {}
        for s in self.live:
            for g, table in enumerate(s.page_tables):
                for p in table:
                    assert p == NULL_PAGE or owner.setdefault(p, g) == g
        for g, group_cached in enumerate(bm.group_cached):
            for key, page in group_cached.items():
                assert bm.page_key[page] == key and bm.page_group[page] == g and owner.get(page, g) == g
        assert len(bm.page_key) == sum(map(len, bm.group_cached))

    @invariant()
    def each_group_reads_back_what_its_next_query_reads(self):
        for s in self.live:
            n = s.num_computed_tokens
            for w, table in zip(self.windows, s.page_tables):
                lo = first_needed(w, n)
                released = [i for i, p in enumerate(table) if p == NULL_PAGE]
                assert released == list(range(len(released))) and len(released) <= lo   # a prefix, none needed
                live = len(released) * PS
                assert self.pool.read(table, n)[live:] == s.token_ids[live:n]


HybridMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestHybridBlockManager = HybridMachine.TestCase


def test_groups_of_layer_patterns():
    """vLLM's grouping: layers of a kind in groups of the fewest of any kind, padded."""
    gpt_oss = KVGroups.of((128, None) * 12)
    assert (gpt_oss.windows, gpt_oss.group_size) == ((None, 128), 12)
    assert gpt_oss.layer_group[:4] == (1, 0, 1, 0) and gpt_oss.layer_entry[:4] == (0, 0, 1, 1)
    gemma3 = KVGroups.of(tuple(None if i % 6 == 5 else 1024 for i in range(62)))   # 27B: 10 full, 52 sliding
    assert gemma3.group_size == 10 and gemma3.windows == (None,) + (1024,) * 6
    assert sorted(zip(gemma3.layer_group, gemma3.layer_entry)) == sorted(set(zip(gemma3.layer_group,
                                                                                 gemma3.layer_entry)))
    mistral = KVGroups.of((4096,) * 32)
    assert (mistral.windows, mistral.group_size, mistral.hybrid) == ((4096,), 32, True)
    for plain in (KVGroups.of((None,) * 4), KVGroups.of((128, None), enabled=False)):
        assert plain.windows == (None,) and plain.layer_entry == tuple(range(len(plain.layer_entry)))
        assert not plain.hybrid


def test_a_hit_shrinks_to_what_the_sliding_group_still_caches():
    """The full pages of a prefix stay (a running sequence holds them), but the sliding group's
    released pages of it were evicted: no page of the prefix serves a hit (each would need its
    window's sliding pages); with them cached the whole prefix does."""
    bm = BlockManager(17, PS, groups=groups_of((None, 4)))
    pool = GroupPool(bm)
    a = seq_of(range(24))
    assert bm.admit(a, bm.match_prefix(a.token_ids), 4)
    while a.num_computed_tokens < 24:   # 4 tokens a step: the sliding group releases as it goes
        copies = bm.reserve(a, 4)
        pool.copy(copies)
        pool.compute(a, 4)
    prompt = list(range(16)) + [99]
    assert bm.match_prefix(prompt).num_tokens == 16
    assert a.group_tables[0][:5] == [NULL_PAGE] * 4 + [a.group_tables[0][4]] and bm.num_cached_pages == 4
    b = seq_of([77] * 40)
    assert bm.admit(b, bm.match_prefix(b.token_ids), 16)    # takes the 4 free pages, then evicts those 4
    assert bm.num_cached_pages == 0
    assert bm.match_prefix(prompt).num_tokens == brute_force_hit(bm, prompt) * PS == 0
    plain = BlockManager(16, PS)
    c = seq_of(range(24))
    assert plain.admit(c, plain.match_prefix(c.token_ids), 24)
    c.num_computed_tokens = 24
    plain.cache_full_pages(c, 24)
    assert plain.match_prefix(prompt).num_tokens == 16


def test_pool_and_request_checks_count_the_window():
    """A request needs its full group's pages for the whole context, a sliding group's for a window
    and a step; the NULL_PAGE is not counted as the pool's."""
    bm = BlockManager(10, PS, groups=groups_of((None, 4)))
    assert sequence_pages(bm.windows, PS, 40, 8) == 10 + 4 and bm.num_free_pages == 9
    assert sequence_pages(BlockManager(10, PS).windows, PS, 40, 8) == 10
    with pytest.raises(ValueError):
        BlockManager(1, PS, groups=groups_of((4,)))
    assert np.isclose(bm.usage, 0)


# ---- the engine ----
WINDOW, NEW_TOKENS = 8, 28
# 4-token pages and 8-token chunks: every prompt is prefilled in chunks, every sequence spans
# several windows; freed and newly taken pages are poisoned with NaN.
ENGINE = dict(page_size=PS, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=8, prefill_chunk_size=8,
              max_prefill_seqs=2, num_pages=96, compilation_cache_dir=None, poison_freed_pages=True,
              step_shapes="largest")
TINY_POOL = {"gpt_oss": 30, "mistral_window": 12}   # preempts: 4 running sequences need more


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    first = rng.integers(0, 256, 30).tolist()
    return [first, first[:24] + rng.integers(0, 256, 18).tolist(), rng.integers(0, 256, 20).tolist()]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (model dir, transformers' greedy tokens of each prompt) of a seeded checkpoint with
    an 8-token window, made on first use: gpt-oss (sliding and full layers alternate: two groups),
    Mistral (all sliding)."""
    from tests.hf_models import hf_greedy, save_byte_tokenizer, save_hf_model

    @functools.cache
    def make(name):
        d = str(tmp_path_factory.mktemp(name))
        hf = save_hf_model(name, d, sliding_window=WINDOW)
        save_byte_tokenizer(d)
        return d, [hf_greedy(hf, p, NEW_TOKENS)[0] for p in _prompts()]
    return make


@pytest.fixture(scope="module", params=sorted(TINY_POOL))
def checkpoint(request, checkpoints):
    """(name, model dir, transformers' greedy tokens of each prompt) of each checkpoint."""
    return request.param, *checkpoints(request.param)


def generate(model_dir: str, n: int = 1, llm=None, **engine):
    """Each prompt's choices' greedy tokens (the first prompt alone first: the others then find its
    prefix cached), the most pages in use after any schedule, and the engine (`llm`'s, else a new one)."""
    from jaxserve import LLM, SamplingParams
    llm = llm or LLM(model=model_dir, **{**ENGINE, **engine})
    scheduler, bm = llm.llm_engine.scheduler, llm.llm_engine.block_manager
    peak, schedule = [0], scheduler.schedule

    def watched(*args, **kwargs):
        out = schedule(*args, **kwargs)
        peak[0] = max(peak[0], bm.num_used_pages)
        return out
    scheduler.schedule = watched
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, n=n)
    prompts = _prompts()
    outs = llm.generate(prompts[:1], sp, use_tqdm=False) + llm.generate(prompts[1:], sp, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs], peak[0], llm.llm_engine


def test_greedy_tokens_match_transformers_with_the_hybrid_cache_on_and_off(checkpoint):
    _, d, expected = checkpoint
    on, on_peak, engine = generate(d)
    off, off_peak, plain = generate(d, hybrid_kv_cache=False)
    assert on == off == [[e] for e in expected]
    assert engine.runner.kv_groups.hybrid and not plain.runner.kv_groups.hybrid
    assert engine.block_manager.prefix_hit_tokens > 0     # the second prompt found the first's prefix
    # out-of-window pages were released: fewer bytes held (a page holds group_size layers' K/V)
    assert on_peak * engine.runner.kv_groups.group_size < off_peak * plain.runner.kv_groups.group_size


def test_preemption_and_forks_with_the_hybrid_cache(checkpoint):
    name, d, expected = checkpoint
    tokens, _, engine = generate(d, n=2, num_pages=TINY_POOL[name])
    assert tokens == [[e, e] for e in expected]
    assert engine.scheduler.num_preemptions > 0


def test_speculation_with_the_hybrid_cache(checkpoint):
    _, d, expected = checkpoint
    spec = {"method": "ngram", "num_tokens": 3, "ngram_min": 1, "ngram_max": 2, "disable_by_batch_size": 8}
    tokens, _, engine = generate(d, speculative=spec)
    assert tokens == [[e] for e in expected]
    assert engine.stats["spec_verify_rows"] > 0


def test_a_draft_model_with_the_hybrid_cache(checkpoint, monkeypatch):
    """Speculation with a draft model: the target's own checkpoint, so its proposals are the
    target's greedy tokens and (nearly) all are accepted, unless its K/V were read through the
    wrong page table (a sliding group's: NULL_PAGE, or another sequence's K/V, where the window
    has passed).
    gpt-oss: hybrid, the draft addressed by the full group's table, verify rows of sequences whose
    sliding pages were released; Mistral (every layer slides): one full group, as before. Greedy
    tokens are transformers' (those without the draft, hybrid on or off: the tests above)."""
    from jaxserve import LLM
    name, d, expected = checkpoint
    llm = LLM(model=d, **ENGINE, speculative={"method": "draft", "model": d, "num_tokens": 3,
                                              "disable_by_batch_size": 8})
    engine, released = llm.llm_engine, []
    propose = engine.draft.propose

    def spy(out):
        released.extend(s for s in out.scheduled if s.num_sampled > 1 and any(NULL_PAGE in t for t in s.seq.group_tables))
        return propose(out)
    monkeypatch.setattr(engine.draft, "propose", spy)
    tokens, _, _ = generate(d, llm=llm)
    assert tokens == [[e] for e in expected]
    stats = engine.stats
    # (all of them here; a near tie of two tokens could cost one. Through a sliding table: 20 of 179)
    assert stats["spec_draft_steps"] > 0 and stats["spec_accepted_tokens"] >= 0.9 * stats["spec_proposed_tokens"] > 0
    if name == "gpt_oss":
        assert engine.runner.kv_groups.windows == (None, WINDOW) and released
    else:
        assert not engine.runner.kv_groups.hybrid and not released


def test_multi_step_decodes_with_the_hybrid_cache(checkpoint):
    """decode_steps 4: the device computes each step's slots from the (grouped) page tables."""
    _, d, expected = checkpoint
    tokens, _, engine = generate(d, decode_steps=4)
    assert tokens == [[e] for e in expected]
    assert engine.stats["multi_step_decodes"] > 0


def test_sleep_and_wake_up_with_the_hybrid_cache(checkpoint):
    """A level-1 sleep drops every group's pages and forgets their cached prefixes; woken, the
    same greedy tokens (a prefix still cached in some group would read zeroed pages), nothing compiled."""
    from jaxserve import LLM
    from jaxserve.compilations import CompileCounter
    _, d, expected = checkpoint
    llm = LLM(model=d, **ENGINE)
    tokens, _, engine = generate(d, llm=llm)
    bm = engine.block_manager
    assert tokens == [[e] for e in expected] and bm.num_cached_pages > 0 and engine.runner.kv_groups.hybrid
    llm.sleep(level=1)
    assert bm.num_cached_pages == 0 and bm.num_used_pages == 0
    compiles = CompileCounter.count
    llm.wake_up()
    hits = bm.prefix_hit_tokens
    again, _, _ = generate(d, llm=llm)
    assert again == tokens and CompileCounter.count == compiles
    assert bm.prefix_hit_tokens > hits   # the second prompt found the first's prefix cached anew


# Both axes on one mesh (one engine a model, not two): the batched step's prefill rows at TP 2,
# which sequence-parallel prefill takes over, run on one device with the hybrid cache above and at
# TP 2 without it in tests/test_parallel.py's data-parallel replicas.
MESH = {"seq": 2, "model": 2}


def test_sequence_parallel_prefill_and_tensor_parallelism_with_the_hybrid_cache(checkpoints):
    """Mesh seq 2 x model 2 (each prefill chunk split over 2 devices, the grouped page rows whole
    on each; the weights and KV heads split over 2), both checkpoints, on fake CPU devices in one
    subprocess (this file's main)."""
    from tests.conftest import fake_devices_env
    runs = {name: checkpoints(name) for name in sorted(TINY_POOL)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "tests.test_hybrid_kv_cache", *(d for d, _ in runs.values())],
                          cwd=root, capture_output=True, text=True, env=fake_devices_env(4), timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for (name, (_, expected)), tokens in zip(runs.items(), json.loads(proc.stdout.strip().splitlines()[-1])):
        assert tokens == [[e] for e in expected], name


if __name__ == "__main__":   # each model dir's run on MESH, on the fake devices of this process
    print(json.dumps([generate(d, mesh=MESH)[0] for d in sys.argv[1:]]))


def test_capacity_of_sliding_window_models():
    """`jaxserve check`'s KV capacity: gpt-oss-20b's layers alternate full and a 128-token window,
    so its pages (of 12 layers, not 24) hold about twice the tokens of 32k-token sequences; Gemma 3
    27B's (10 of 62 layers full, the 52 sliding in 6 groups of 10) 4.6 times, counting each sliding
    group's window and a whole 1024-token step; Llama's as many as before."""
    from jaxserve import sizing
    from jaxserve.config import EngineConfig, ModelConfig
    from jaxserve.kv_cache import page_bytes_per_chip
    from jaxserve.kv_groups import kv_groups
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, low, high in (("gpt-oss-20b", 1.9, 2.0), ("gemma-3-27b", 4.5, 4.7), ("llama3-8b", 1.0, 1.0)):
        cfg = ModelConfig.from_pretrained(os.path.join(root, "configs", "models", name))
        ecfg = EngineConfig(max_model_len=32768, page_size=16, max_num_batched_tokens=1024)
        pool = 80 * 2**30   # bytes of KV pages

        def tokens(groups):
            pages = pool // page_bytes_per_chip(cfg, "bfloat16", 16, 1, False, groups=groups)
            return sizing.context_tokens(cfg, ecfg, groups, pages)
        gain = tokens(kv_groups(cfg, ecfg)) / tokens(KVGroups.of(cfg.sliding_windows, enabled=False))
        assert low <= gain <= high, (name, gain)
