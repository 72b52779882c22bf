"""The KV block manager against a model of what each page holds: after any sequence of admit / grow /
preempt / cancel / finish, no page is leaked or owned twice, reference counts equal the number of
tables holding a page, and a prefix-cache hit hands out only pages whose KV was written for exactly
the same token prefix (the model records, per page slot, the prefix that produced it)."""
from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from imp_runtime.kv_blocks import BlockManager, BlockTable

PAGE = 4
PAGES = 10          # 9 usable: small, so pools run out and eviction happens often
ALPHABET = st.integers(0, 2)      # few distinct tokens: prompts share prefixes often


class Seq:
    def __init__(self, tokens: list[int]):
        self.table = BlockTable()
        self.tokens = tokens
        self.computed = 0


class BlockManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(PAGES, PAGE)
        self.live: list[Seq] = []
        self.slot_prefix: dict[tuple[int, int], tuple] = {}     # (page, offset) -> token prefix its KV is of

    def _write(self, seq: Seq, upto: int) -> None:
        """The executor writing KV of positions seq.computed .. upto-1 into the sequence's pages."""
        for pos in range(seq.computed, upto):
            page = seq.table.pages[pos // PAGE]
            assert self.bm.refs[page] == 1, "a sequence writes into a page another sequence shares"
            self.slot_prefix[(page, pos % PAGE)] = tuple(seq.tokens[:pos + 1])
        seq.computed = upto
        self.bm.commit(seq.table, seq.tokens, upto)

    @rule(target=seqs, tokens=st.lists(ALPHABET, min_size=1, max_size=14))
    def admit(self, tokens):
        seq = Seq(tokens)
        hit = self.bm.acquire_prefix(seq.table, tokens, len(tokens) - 1)
        assert hit % PAGE == 0 and hit <= len(tokens) - 1
        for pos in range(hit):                   # the oracle: cached KV is of this very prefix
            assert self.slot_prefix[(seq.table.pages[pos // PAGE], pos % PAGE)] == tuple(tokens[:pos + 1])
        seq.computed = hit
        if not self.bm.grow(seq.table, len(tokens)):
            self.bm.release(seq.table)           # does not fit now: it waits (holds nothing)
            assert not seq.table.pages
            return seq
        self._write(seq, len(tokens))
        self.live.append(seq)
        return seq

    @rule(seq=seqs, extra=st.lists(ALPHABET, min_size=1, max_size=6))
    def grow(self, seq, extra):
        """Decode steps; when pages run out the sequence is preempted (everything released)."""
        if seq not in self.live:
            return
        seq.tokens = seq.tokens + extra
        if self.bm.grow(seq.table, len(seq.tokens)):
            self._write(seq, len(seq.tokens))
        else:
            self.live.remove(seq)
            self.bm.release(seq.table)

    @rule(seq=consumes(seqs))
    def finish_or_cancel(self, seq):
        if seq in self.live:
            self.live.remove(seq)
            self.bm.release(seq.table)
        assert not seq.table.pages

    @invariant()
    def every_page_in_exactly_one_state(self):
        bm = self.bm
        free, evictable = list(bm.free), list(bm.evictable)
        referenced = [p for p in range(1, PAGES) if bm.refs[p] > 0]
        states = free + evictable + referenced
        assert sorted(states) == list(range(1, PAGES)), "a page leaked or is in two states"
        assert 0 not in states and bm.refs[0] == 0
        assert bm.in_use() == len(referenced)

    @invariant()
    def refs_count_tables(self):
        holders: dict[int, int] = {}
        for seq in self.live:
            assert len(set(seq.table.pages)) == len(seq.table.pages), "a table holds a page twice"
            for p in seq.table.pages:
                holders[p] = holders.get(p, 0) + 1
        for p in range(1, PAGES):
            assert self.bm.refs[p] == holders.get(p, 0)
            if holders.get(p, 0) > 1:
                assert p in self.bm.key_of, "a shared page must be a full cached one"

    @invariant()
    def cache_maps_agree(self):
        bm = self.bm
        assert {p: k for k, p in bm.cached.items()} == bm.key_of
        assert all(p in bm.key_of and bm.refs[p] == 0 for p in bm.evictable)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_lru_evicts_only_unreferenced_pages_oldest_first():
    bm = BlockManager(5, 2)                        # pages 1..4
    a, b = BlockTable(), BlockTable()
    assert bm.grow(a, 4) and bm.grow(b, 4)         # a: pages 1,2  b: pages 3,4
    bm.commit(a, [1, 2, 3, 4], 4)
    bm.commit(b, [5, 6, 7, 8], 4)
    bm.release(a)                                  # a's pages are cached, unreferenced
    assert bm.available() == 2 and bm.in_use() == 2
    c = BlockTable()
    assert not bm.grow(c, 6)                       # 3 pages wanted, 2 reclaimable: all or nothing
    assert c.pages == [] and bm.available() == 2
    assert bm.grow(c, 2)                           # evicts a's tail page first (page 2)
    assert c.pages == [2]
    d = BlockTable()
    assert bm.acquire_prefix(d, [1, 2, 3, 4, 9], 4) == 2      # a's first page is still cached
    assert d.pages == [1]
    e = BlockTable()
    assert not bm.grow(e, 1)                       # page 1 is referenced again, b's pages are held
    bm.release(b)
    f = BlockTable()
    assert bm.acquire_prefix(f, [5, 6, 7, 8, 0], 4) == 4 and f.pages == [3, 4]


def test_a_prefix_hit_needs_every_earlier_token_equal():
    bm = BlockManager(9, 2)
    a = BlockTable()
    bm.grow(a, 6)
    bm.commit(a, [1, 2, 3, 4, 5, 6], 6)
    bm.release(a)
    b = BlockTable()
    assert bm.acquire_prefix(b, [9, 2, 3, 4, 5, 6, 7], 6) == 0      # same second page, different first
    c = BlockTable()
    assert bm.acquire_prefix(c, [1, 2, 3, 4, 5, 6], 5) == 4         # at most 5 tokens: two whole pages


def test_prefix_keys_are_the_page_by_page_chain():
    """The key chain against the keys written out page by page (blake2b of the previous key and the page's int64
    tokens), from the start and from a page in the middle; a prefix shares keys, a changed token changes its
    page's key and every later one."""
    import hashlib

    from imp_runtime.kv_blocks import prefix_keys
    rng = np.random.default_rng(4)
    tokens, ps = rng.integers(0, 150000, 16 * 9 + 5).tolist(), 16
    chain, key = [], b""
    for i in range(9):
        page = np.asarray(tokens[i * ps:(i + 1) * ps], np.int64).tobytes()
        key = hashlib.blake2b(key + page, digest_size=16).digest()
        chain.append(key)
    assert list(prefix_keys(b"", tokens, 0, 9, ps)) == chain
    assert list(prefix_keys(chain[3], tokens, 4, 9, ps)) == chain[4:]
    changed = tokens[:5 * ps + 2] + [tokens[5 * ps + 2] + 1] + tokens[5 * ps + 3:]
    other = list(prefix_keys(b"", changed, 0, 9, ps))
    assert other[:5] == chain[:5] and all(a != b for a, b in zip(other[5:], chain[5:]))
