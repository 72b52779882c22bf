"""The KV block manager: which pages of the executor's pool hold which sequence's keys and values.

Every usable page (1 .. num_pages - 1; page 0 is the executor's padding page) is in exactly one state:
- free: holds nothing worth keeping;
- referenced: in the block table of one or more sequences (more than one only for a shared, full,
  cached prefix page: its KV never changes again);
- cached and unreferenced: a full page whose KV is still valid, kept for the prefix cache and evicted
  least recently used first when a sequence needs a page and none is free.

The prefix cache keys a full page by a hash of the whole token prefix up to its end (a chain: the
page's tokens and the previous page's key), so two prompts share a page only when every token before
it is the same. A sequence only ever writes into its own last, partial page.
"""
from __future__ import annotations

import collections
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class BlockTable:
    """One sequence's pages in position order (page i holds positions i*page_size ...)."""
    pages: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)   # prefix keys of pages[:len(keys)], the full ones


def prefix_keys(previous: bytes, tokens: list[int], first: int, end: int, page_size: int):
    """The prefix keys of pages first .. end - 1 of `tokens`: a page's key is blake2b (16 bytes) of the key before
    it (`previous` for page `first`: page first - 1's key, b"" for page 0) and its tokens as int64. The tokens
    are converted to bytes once (a conversion a page was most of a warm 2,000-token prompt's lookup)."""
    raw, step = np.asarray(tokens[first * page_size:end * page_size], dtype=np.int64).tobytes(), page_size * 8
    for i in range(end - first):
        previous = hashlib.blake2b(previous + raw[i * step:(i + 1) * step], digest_size=16).digest()
        yield previous


class OutOfPages(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least one page besides the padding page")
        self.num_pages, self.page_size = num_pages, page_size
        self.refs = [0] * num_pages
        self.free: collections.deque[int] = collections.deque(range(1, num_pages))
        self.cached: dict[bytes, int] = {}                     # prefix key -> page
        self.key_of: dict[int, bytes] = {}                     # page -> prefix key, for cached pages
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()   # LRU first

    # --- counts ---

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Pages a sequence can get now: free ones and unreferenced cached ones."""
        return len(self.free) + len(self.evictable)

    def in_use(self) -> int:
        """Pages referenced by some sequence (cached unreferenced pages do not count: they are reclaimable)."""
        return self.usable - self.available()

    def pages_for(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.page_size)

    # --- a sequence's life ---

    def acquire_prefix(self, table: BlockTable, tokens: list[int], max_tokens: int) -> int:
        """Give an empty table the cached pages of the longest cached prefix of `tokens` that is at most
        `max_tokens` long, in whole pages; returns the number of tokens whose KV they hold."""
        assert not table.pages, "a prefix is acquired by a sequence with no pages yet"
        for key in prefix_keys(b"", tokens, 0, max_tokens // self.page_size, self.page_size):
            page = self.cached.get(key)
            if page is None:
                break
            if self.refs[page] == 0:
                del self.evictable[page]
            self.refs[page] += 1
            table.pages.append(page)
            table.keys.append(key)
        return len(table.pages) * self.page_size

    def can_grow(self, table: BlockTable, n_tokens: int) -> bool:
        return self.pages_for(n_tokens) - len(table.pages) <= self.available()

    def grow(self, table: BlockTable, n_tokens: int) -> bool:
        """Make the table cover n_tokens positions; all or nothing (False: not enough pages)."""
        need = self.pages_for(n_tokens) - len(table.pages)
        if need > self.available():
            return False
        for _ in range(need):
            page = self.free.popleft() if self.free else self._evict()
            self.refs[page] = 1
            table.pages.append(page)
        return True

    def commit(self, table: BlockTable, tokens: list[int], n_computed: int) -> None:
        """Enter the table's pages whose KV is now complete (all page_size positions < n_computed
        written) into the prefix cache. `tokens` are the sequence's tokens, at least n_computed of them."""
        first = len(table.keys)
        end = min(n_computed // self.page_size, len(table.pages))
        for i, key in enumerate(prefix_keys(table.keys[-1] if table.keys else b"", tokens, first, end, self.page_size),
                                first):
            page = table.pages[i]
            if key not in self.cached and page not in self.key_of:
                self.cached[key] = page
                self.key_of[page] = key
            table.keys.append(key)        # the chain continues even where another page holds this key

    def release(self, table: BlockTable) -> None:
        """The sequence is done with its pages (finished, cancelled or preempted). Cached ones stay
        cached, the tail's first in line for eviction (a shorter shared prefix is likelier to recur)."""
        for page in reversed(table.pages):
            self.refs[page] -= 1
            assert self.refs[page] >= 0, f"page {page} released more often than acquired"
            if self.refs[page] == 0:
                if page in self.key_of:
                    self.evictable[page] = None
                else:
                    self.free.append(page)
        table.pages.clear()
        table.keys.clear()

    def _evict(self) -> int:
        page, _ = self.evictable.popitem(last=False)
        del self.cached[self.key_of.pop(page)]
        return page


class SoloSequence:
    """One sequence on an executor with pages from its own block manager: how tests and benchmarks drive
    an executor directly (prefill, then decode one token at a time) without the scheduler. Only for an
    executor that no scheduler is using at the same time."""

    def __init__(self, executor, blocks: BlockManager | None = None):
        self.ex = executor
        self.blocks = blocks or BlockManager(executor.num_pages, executor.page_size)
        self.table = BlockTable()
        self.sid = executor.new_sequence()
        self.length = 0

    def _cover(self, n: int) -> None:
        if not self.blocks.grow(self.table, n):
            raise OutOfPages(f"no KV pages left for {n} positions")
        self.ex.set_pages(self.sid, list(self.table.pages))

    def prefill(self, tokens: list[int], all_logits: bool = False) -> np.ndarray:
        """Prefill in the executor's chunks; the logits of the last token [V], or of all [T, V]."""
        self._cover(self.length + len(tokens))
        out = []
        for i in range(0, len(tokens), self.ex.prefill_chunk):
            chunk = tokens[i:i + self.ex.prefill_chunk]
            out.append(self.ex.prefill(self.sid, chunk, self.length, all_logits))
            self.length += len(chunk)
        return np.concatenate(out) if all_logits else out[-1]

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; its logits [1, V] (the shape the old executor's decode returned for one row)."""
        from imp_runtime.executor import StepRow
        self._cover(self.length + 1)
        res = self.ex.decode([StepRow(self.sid, token, self.length, None, want_logits=True)])
        self.length += 1
        return res.logits[0][None]

    def close(self) -> None:
        self.ex.free(self.sid)
        self.blocks.release(self.table)
