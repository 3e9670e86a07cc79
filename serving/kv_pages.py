"""The KV page pool: free list, per-sequence page tables, reference counts and a prefix cache.

Every page is in exactly one of three states:
  free    on the free list, content meaningless;
  used    referenced by one or more sequences' page tables (ref count > 0);
  cached  unreferenced but holding a full page of some prefix, findable by its key and evicted
          least-recently-used when the pool needs room.
A sequence's table keeps one entry per page of its tokens, in order. An entry is DROPPED once the
sequence has given that page back early: with a sliding window on every layer, pages wholly
before the window are never read again (`kv_window.py`).
A full page's key is a hash chain: the digest of (the previous page's key, this page's tokens), the
chain starting from the model's key, so one digest names a whole prefix. Only full pages are ever
shared, and sequences only write past their shared prefix, so shared pages are never written.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

DROPPED = -1  # a table entry whose page went back to the pool before the sequence ended


def page_digest(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + array("i", tokens).tobytes(), digest_size=16).digest()


def chain_digests(keys: list[bytes], root: bytes, tokens, page_size: int, n: int) -> list[bytes]:
    """Extend `keys`, the digests of the first full pages of `tokens` (chained from `root`), to
    its first `n` pages: one byte conversion for all the new pages, then a hash per page (each
    what `page_digest` gives)."""
    if len(keys) < n:
        step, parent = 4 * page_size, keys[-1] if keys else root
        data = array("i", tokens[len(keys) * page_size:n * page_size]).tobytes()
        blake2b = hashlib.blake2b
        for j in range(0, len(data), step):
            parent = blake2b(parent + data[j:j + step], digest_size=16).digest()
            keys.append(parent)
    return keys


class KVPages:
    def __init__(self, num_pages: int, page_size: int, model_key: str = ""):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self.root = hashlib.blake2b(model_key.encode(), digest_size=16).digest()
        self.free_list = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self.refs = [0] * num_pages
        self.tables: dict[object, list[int]] = {}
        self.digests: dict[object, list[bytes]] = {}  # keys of each sequence's full, cached pages
        self.cache: dict[bytes, int] = {}  # key -> page
        self.key_of: dict[int, bytes] = {}  # page -> key, for every page in `cache`
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, oldest first

    # -- queries -------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_available(self) -> int:
        """Pages an allocation can take: free ones plus evictable cached ones."""
        return len(self.free_list) + len(self.lru)

    def table(self, seq) -> list[int]:
        return self.tables[seq]

    def stats(self) -> dict:
        used = self.num_pages - len(self.free_list) - len(self.lru)
        return dict(pages_total=self.num_pages, pages_free=len(self.free_list),
                    pages_used=used, pages_cached=len(self.lru))

    # -- sequence lifecycle --------------------------------------------------------------------
    def share_prefix(self, seq, tokens, keys: list[bytes] | None = None) -> int:
        """Start `seq`'s table with the cached pages matching the longest run of full pages of
        `tokens`; returns how many tokens they hold. Callers pass all but the last known token so
        at least one token is left to compute. `keys`: the sequence's page digests so far (a list
        its caller keeps and this extends), so each page is hashed once in a sequence's life."""
        assert seq not in self.tables, f"sequence {seq!r} already has pages"
        n = len(tokens) // self.page_size
        keys = chain_digests([] if keys is None else keys, self.root, tokens, self.page_size, n)
        table, cache = [], self.cache
        for key in keys[:n]:
            page = cache.get(key)
            if page is None:
                break
            table.append(page)
        for page in table:
            self._ref(page)
        self.tables[seq], self.digests[seq] = table, keys[:len(table)]
        return len(table) * self.page_size

    def grow(self, seq, num_tokens: int) -> bool:
        """Make `seq`'s table cover `num_tokens` tokens. All or nothing: False if the pool cannot."""
        table = self.tables.setdefault(seq, [])
        self.digests.setdefault(seq, [])
        need = self.pages_for(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_available():
            return False
        pages = self._take(need)
        for page in pages:
            self.refs[page] = 1
        table += pages
        return True

    def grow_each_by_one(self, seqs) -> list[int] | None:
        """One more page for each of `seqs`, from the free list and then the LRU's oldest
        cached pages, handed out as `grow` one sequence after another would; None (nothing
        taken) if the pool is short."""
        if len(seqs) > self.num_available():
            return None
        pages = self._take(len(seqs))
        tables, refs = self.tables, self.refs
        for seq, page in zip(seqs, pages):
            tables[seq].append(page)
            refs[page] = 1
        return pages

    def shrink(self, seq, num_tokens: int):
        """Give back the pages of `seq` past its first `num_tokens` tokens (rolled-back
        speculative tokens): they hold no full cached page, so they go to the free list."""
        table = self.tables[seq]
        while len(table) > self.pages_for(num_tokens):
            self._unref(table.pop())

    def drop(self, seq, first: int, end: int) -> int:
        """Give back `seq`'s pages [first, end) of its table early (they leave DROPPED entries):
        a page shared through the prefix cache loses one reference, a cached one becomes
        evictable, any other is free. Returns how many pages it gave back."""
        table, n = self.tables[seq], 0
        for i in range(first, min(end, len(table))):
            if table[i] != DROPPED:
                self._unref(table[i])
                table[i], n = DROPPED, n + 1
        return n

    def cache_full_pages(self, seq, tokens, upto: int | None = None,
                         keys: list[bytes] | None = None):
        """Enter `seq`'s full pages into the prefix cache. `tokens[:upto]` are the sequence's
        tokens whose K/V are written (or queued to be written ahead of any reader) in its pages.
        Cheap when no page filled up since the last call (the common decode step). `keys`: as
        for `share_prefix`."""
        self.cache_pages_of([(seq, tokens, len(tokens) if upto is None else upto, keys)])

    def cache_pages_of(self, items):
        """`cache_full_pages` for each (seq, tokens, upto, keys) of `items` (a step's rows)."""
        ps, root, digests, tables = self.page_size, self.root, self.digests, self.tables
        cache, key_of = self.cache, self.key_of
        for seq, tokens, upto, keys in items:
            done, table = digests[seq], tables[seq]
            first, full = len(done), min(len(tokens), upto, len(table) * ps) // ps
            if full <= first:
                continue
            keys = chain_digests(list(done) if keys is None else keys, root, tokens, ps, full)
            for key, page in zip(keys[first:full], table[first:full]):
                if page != DROPPED and key not in cache and page not in key_of:
                    cache[key], key_of[page] = page, key
            done += keys[first:full]

    def free(self, seq):
        """Drop `seq`'s references. Unreferenced cached pages join the LRU tail-first, so a
        prefix's later pages are evicted before its earlier ones (which keep the rest findable)."""
        table = self.tables.pop(seq, [])
        self.digests.pop(seq, None)
        self._unref_all(reversed(table))

    def cached_prefix_tokens(self, tokens) -> int:
        """Tokens of the longest run of full pages of `tokens` in the prefix cache (read only)."""
        parent, n = self.root, 0
        for i in range(len(tokens) // self.page_size):
            parent = page_digest(parent, tokens[i * self.page_size:(i + 1) * self.page_size])
            if parent not in self.cache:
                break
            n += self.page_size
        return n

    def reset_cache(self):
        """Forget every cached prefix: unreferenced cached pages return to the free list, and
        pages still held stay their sequences' but are no longer found by later prompts."""
        self.free_list.extend(reversed(self.lru))
        self.lru.clear()
        self.cache.clear()
        self.key_of.clear()

    # -- internals -----------------------------------------------------------------------------
    def _ref(self, page: int):
        if self.refs[page] == 0:
            self.lru.pop(page)
        self.refs[page] += 1

    def _unref(self, page: int):
        self._unref_all((page,))

    def _unref_all(self, pages):
        refs, key_of, lru, free = self.refs, self.key_of, self.lru, self.free_list
        for page in pages:
            if page != DROPPED:
                refs[page] -= 1
                if refs[page] == 0:
                    if page in key_of:
                        lru[page] = None
                    else:
                        free.append(page)

    def _take(self, k: int) -> list[int]:
        """k pages (the caller has checked there are): off the free list's end, then the LRU's
        oldest cached pages, evicted."""
        free = self.free_list
        pages = free[len(free) - min(k, len(free)):][::-1]
        del free[len(free) - len(pages):]
        lru, cache, key_of = self.lru, self.cache, self.key_of
        for _ in range(k - len(pages)):
            page, _ = lru.popitem(last=False)
            del cache[key_of.pop(page)]
            pages.append(page)
        return pages

    def check(self):
        """Assert every invariant of the pool (used by tests)."""
        counts = [0] * self.num_pages
        for seq, table in self.tables.items():
            held = [p for p in table if p != DROPPED]
            assert len(set(held)) == len(held), f"{seq!r} holds a page twice"
            for page in held:
                counts[page] += 1
        assert counts == self.refs, "ref counts differ from the page tables"
        free = set(self.free_list)
        assert len(free) == len(self.free_list), "a page is on the free list twice"
        assert all(self.refs[p] == 0 and p not in self.key_of for p in free), "bad free page"
        assert set(self.lru) == {p for p in self.key_of if self.refs[p] == 0}, "LRU != idle cache"
        assert not free & set(self.lru), "a page is both free and cached"
        used = sum(1 for r in self.refs if r > 0)
        assert len(free) + len(self.lru) + used == self.num_pages, "a page leaked"
        assert {v: k for k, v in self.cache.items()} == self.key_of, "cache maps disagree"
        for seq, keys in self.digests.items():
            assert len(keys) <= len(self.tables[seq])
