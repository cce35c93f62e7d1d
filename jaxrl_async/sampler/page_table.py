"""Host side of the paged KV cache: page pools with reference counts, per-slot page tables, page arithmetic.

The device holds, per layer, a K and a V pool of pages [G, data * pages_per_shard, page_size, K]; data shard
d owns pages [d * pages_per_shard, (d + 1) * pages_per_shard) and its slots use only those, so the page ids
in a table are local to the slot's shard. Page 0 of every shard is a scratch page: free table entries point
at it, and writes that must not land anywhere (finished or released slots, prompt chunks another sample
already wrote) go there.

A sequence of prompt length p writes keys/values at positions 0 .. p + max_new - 2 (the last token is never
fed back). The group samples of one prompt share its full pages below position p - 1 by reference (the
position p - 1 is rewritten by each sample's first decode step, so the page holding it is private); a page
is returned to its free list when its last reference goes.

The module itself uses only Python and numpy. The page arithmetic lives in `jaxrl_async.paging`, which
the performance model shares (its batch cap follows the sampler's rule without importing the sampler).
"""

from __future__ import annotations

import numpy as np

from jaxrl_async.paging import mean_resident_tokens, pages_for, positions_after, shared_pages

__all__ = ["SCRATCH", "PageTable", "mean_resident_tokens", "pages_for", "positions_after", "shared_pages"]

SCRATCH = 0  # page id every shard keeps as a write sink / empty table entry


class PageTable:
    """Page pools (one per data shard) with reference counts, and the page table of every slot.

    Attributes:
      table: int32 [num_slots, width] local page ids per slot (SCRATCH where unused); the device copy is
        uploaded with every call that reads it.
      version: bumped whenever `table` changes (callers re-upload only then).
    """

    def __init__(self, num_slots: int, shards: int, pages_per_shard: int, width: int, page_size: int):
        if num_slots % shards:
            raise ValueError(f"num_slots={num_slots} is not a multiple of the data shards ({shards})")
        if pages_per_shard < 2:
            raise ValueError(f"a shard needs a scratch page and at least one page, got {pages_per_shard}")
        self.num_slots, self.shards, self.page_size = num_slots, shards, page_size
        self.pages_per_shard, self.width = pages_per_shard, width
        self.table = np.full((num_slots, width), SCRATCH, np.int32)
        self.version = 0
        self._refs = np.zeros((shards, pages_per_shard), np.int64)
        # Free lists as stacks; low ids come out first, so a lightly loaded pool stays compact.
        self._free = [list(range(pages_per_shard - 1, SCRATCH, -1)) for _ in range(shards)]
        self._slot_pages: list[list[int]] = [[] for _ in range(num_slots)]

    # ----- queries -----

    def shard_of(self, slot: int) -> int:
        return slot // (self.num_slots // self.shards)

    def num_free(self, shard: int) -> int:
        return len(self._free[shard])

    def slot_pages(self, slot: int) -> list[int]:
        return list(self._slot_pages[slot])

    def refcount(self, shard: int, page: int) -> int:
        return int(self._refs[shard, page])

    @property
    def capacity(self) -> int:
        """Usable pages per shard (the scratch page excluded)."""
        return self.pages_per_shard - 1

    # ----- allocation -----

    def alloc(self, shard: int, n: int) -> list[int]:
        """n fresh pages of `shard` with one reference each.

        Raises:
          RuntimeError: fewer than n pages are free (callers check `num_free` first).
        """
        if n > len(self._free[shard]):
            raise RuntimeError(f"shard {shard}: {n} pages wanted, {len(self._free[shard])} free")
        pages = [self._free[shard].pop() for _ in range(n)]
        self._refs[shard, pages] += 1
        return pages

    def incref(self, shard: int, pages: list[int]) -> None:
        for p in pages:
            if self._refs[shard, p] <= 0:
                raise RuntimeError(f"shard {shard}: page {p} is not allocated")
            self._refs[shard, p] += 1

    def decref(self, shard: int, pages: list[int]) -> None:
        """Drops one reference from each page; pages with none left go back to the free list."""
        for p in pages:
            if self._refs[shard, p] <= 0:
                raise RuntimeError(f"shard {shard}: page {p} released more often than referenced")
            self._refs[shard, p] -= 1
            if self._refs[shard, p] == 0:
                self._free[shard].append(p)

    # ----- slots -----

    def assign(self, slot: int, shared: list[int], n_private: int) -> list[int]:
        """Gives a free slot the `shared` pages (one more reference each) followed by n_private new pages.

        Returns the private pages. Raises RuntimeError when the slot holds pages or pages run out.
        """
        if self._slot_pages[slot]:
            raise RuntimeError(f"slot {slot} still holds pages {self._slot_pages[slot]}")
        shard = self.shard_of(slot)
        if len(shared) + n_private > self.width:
            raise RuntimeError(f"slot {slot}: {len(shared) + n_private} pages exceed the table width")
        private = self.alloc(shard, n_private)
        self.incref(shard, shared)
        self._slot_pages[slot] = list(shared) + private
        self._write_row(slot)
        return private

    def grow(self, slot: int, n_total: int) -> bool:
        """Extends a slot to n_total pages; False (nothing changed) when its shard has too few free pages."""
        have = len(self._slot_pages[slot])
        need = min(n_total, self.width) - have
        if need <= 0:
            return True
        shard = self.shard_of(slot)
        if need > self.num_free(shard):
            return False
        self._slot_pages[slot] += self.alloc(shard, need)
        self._write_row(slot)
        return True

    def release(self, slot: int) -> None:
        """Drops the slot's references (shared pages survive while other holders remain)."""
        pages = self._slot_pages[slot]
        if pages:
            self.decref(self.shard_of(slot), pages)
            self._slot_pages[slot] = []
            self._write_row(slot)

    def _write_row(self, slot: int) -> None:
        row = self._slot_pages[slot]
        self.table[slot] = SCRATCH
        self.table[slot, : len(row)] = row
        self.version += 1

    # ----- invariants (tests) -----

    def check(self, holds: list[tuple[int, list[int]]] = ()) -> None:
        """Raises AssertionError unless every reference count equals the references that slots and `holds`
        (shard, pages) have, and free pages are exactly those with none."""
        expected = np.zeros_like(self._refs)
        for slot, pages in enumerate(self._slot_pages):
            for p in pages:
                expected[self.shard_of(slot), p] += 1
            assert list(self.table[slot, : len(pages)]) == pages and not self.table[slot, len(pages) :].any()
        for shard, pages in holds:
            for p in pages:
                expected[shard, p] += 1
        assert (expected == self._refs).all(), "reference counts differ from the references held"
        for shard in range(self.shards):
            free = sorted(self._free[shard])
            assert free == sorted(set(free)), "a page is on a free list twice"
            unused = [p for p in range(1, self.pages_per_shard) if self._refs[shard, p] == 0]
            assert free == unused, f"shard {shard}: free list {free} != unreferenced pages {unused}"
