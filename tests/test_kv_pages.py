"""The KV page pool: prefix sharing, LRU eviction, and a property test of its invariants."""

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pallasite.serving.kv_pages import KVPages, chain_digests, page_digest


def test_prefix_pages_are_shared_and_survive_their_sequence():
    kv = KVPages(num_pages=8, page_size=4)
    a = list(range(10))
    assert kv.share_prefix("a", a[:-1]) == 0
    assert kv.grow("a", len(a))
    kv.cache_full_pages("a", a)
    kv.free("a")
    kv.check()
    assert kv.stats() == dict(pages_total=8, pages_free=6, pages_used=0, pages_cached=2)
    # Same first 9 tokens: both full pages are found; a different second page stops the match.
    assert kv.share_prefix("b", a[:9]) == 8
    assert kv.share_prefix("c", a[:4] + [99] * 5) == 4
    assert kv.table("c")[0] == kv.table("b")[0]
    kv.check()


def test_model_key_separates_caches():
    kv = KVPages(4, 2, model_key="m1")
    kv.grow("a", 4)
    kv.cache_full_pages("a", [1, 2, 3, 4])
    other = KVPages(4, 2, model_key="m2")
    assert other.root != kv.root
    assert kv.share_prefix("b", [1, 2, 3]) == 2


def test_eviction_takes_oldest_and_prefix_tails_first():
    kv = KVPages(num_pages=4, page_size=2)
    for seq, toks in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        kv.grow(seq, 4)
        kv.cache_full_pages(seq, toks)
        kv.free(seq)
    assert kv.num_available() == 4 and kv.stats()["pages_cached"] == 4
    kv.grow("c", 2)  # evicts a's second page: a's first page still matches
    kv.check()
    assert kv.share_prefix("d", [1, 2, 3, 4]) == 2
    assert not kv.grow("e", 2 * 5)  # all or nothing
    kv.check()


def test_page_digests_are_hashed_once_and_match_the_chain():
    kv = KVPages(num_pages=16, page_size=4)
    toks = list(range(100, 123))
    parent, chain = kv.root, []
    for i in range(5):
        parent = page_digest(parent, toks[4 * i:4 * i + 4])
        chain.append(parent)
    keys = chain_digests([], kv.root, toks, 4, 2)
    assert keys == chain[:2] and chain_digests(keys, kv.root, toks, 4, 5) is keys
    assert keys == chain
    # With a sequence's memo, admission and caching find the same pages as without one.
    memo = []
    assert kv.share_prefix("a", toks[:-1], memo) == 0 and memo == chain
    kv.grow("a", len(toks))
    kv.cache_full_pages("a", toks, 9, memo)
    kv.cache_full_pages("a", toks, None, memo)
    assert [kv.cache[k] for k in chain] == kv.table("a")[:5]
    memo.append(b"not a digest")  # a memo longer than the prompt's pages is only read up to them
    assert kv.share_prefix("b", toks[:10], memo) == 8 and kv.share_prefix("c", toks[:-1]) == 20
    kv.check()


def test_one_page_each_evicts_as_growing_one_by_one_does():
    pools = []
    for batched in (False, True):
        kv = KVPages(num_pages=8, page_size=2)
        for seq, toks in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
            kv.grow(seq, 4)
            kv.cache_full_pages(seq, toks)
        kv.free("a")  # 4 free pages and a's 2 cached ones
        for seq in "xyz":
            kv.grow(seq, 1)
        if batched:
            assert kv.grow_each_by_one(list("xyz")) is not None
            assert kv.grow_each_by_one(list("xyz")) is None  # short: nothing taken
        else:
            for seq in "xyz":
                kv.grow(seq, 3)
        kv.check()
        pools.append((dict(kv.tables), dict(kv.cache), list(kv.lru)))
    assert pools[0] == pools[1]
    assert len(pools[1][1]) == 2  # the free page went first, then both of a's cached ones


class PoolMachine(RuleBasedStateMachine):
    """Random sequences over a tiny alphabet (so prefixes collide) allocate, grow, cache, share
    and free pages. A shadow copy of every page's content checks that a shared prefix page holds
    exactly the tokens the sharing sequence expects."""

    def __init__(self):
        super().__init__()
        self.kv = KVPages(num_pages=12, page_size=2)
        self.tokens = {}  # seq -> tokens it has "written"
        self.content = {}  # page -> token per slot, as written
        self.next_id = 0

    def _write(self, seq, start):
        table, toks = self.kv.table(seq), self.tokens[seq]
        for i in range(start, len(toks)):
            page = self.content.setdefault(table[i // 2], [None, None])
            page[i % 2] = toks[i]

    @rule(toks=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def start(self, toks):
        seq = self.next_id
        self.next_id += 1
        hit = self.kv.share_prefix(seq, toks[:-1])
        for i, page in enumerate(self.kv.table(seq)):
            assert self.content[page] == toks[2 * i:2 * i + 2], "shared page holds other tokens"
        if self.kv.grow(seq, len(toks)):
            self.tokens[seq] = toks
            self._write(seq, hit)
        else:
            self.kv.free(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def extend(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        old = len(self.tokens[seq])
        if self.kv.grow(seq, old + len(extra)):
            self.tokens[seq] = self.tokens[seq] + extra
            self._write(seq, old)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.cache_full_pages(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(seq)
        del self.tokens[seq]

    @invariant()
    def consistent(self):
        self.kv.check()
        assert sum(self.kv.stats()[k] for k in ("pages_free", "pages_used", "pages_cached")) == 12


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase
