"""Host side of the KV cache: page pools with reference counts, per-slot page tables, page arithmetic, and
the planners that decide admission, placement, growth and preemption (`PagePlanner`, `SlotPlanner`).

The device holds, per layer, a K and a V pool of pages [G, data * pages_per_shard, page_size, K]; data shard
d owns pages [d * pages_per_shard, (d + 1) * pages_per_shard) and its slots use only those, so the page ids
in a table are local to the slot's shard. Page 0 of every shard is a scratch page: free table entries point
at it, and writes that must not land anywhere (finished or released slots, prompt chunks another sample
already wrote) go there.

A sequence of prompt length p writes keys/values at positions 0 .. p + max_new - 2 (the last token is never
fed back). The group samples of one prompt share its full pages below position p - 1 by reference (the
position p - 1 is rewritten by each sample's first decode step, so the page holding it is private); a page
is returned to its free list when its last reference goes.

The planners own the page policy the sampler loop follows (docs/sampler.md, "Admission by memory"); they
take numbers (prompt lengths, generation limits, slot ids), never the loop's records, so they are tested
without an engine. `SlotPlanner` is the slotted cache's trivial policy (a free slot is all a sequence
needs), so the loop has one code path for both caches.

The module itself uses only Python and numpy (the device copy of a table is made by a function the engine
passes in). The page arithmetic lives in `jaxrl_async.paging`, which the performance model shares (its
batch cap follows the sampler's rule without importing the sampler).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection

import numpy as np

from jaxrl_async.paging import mean_resident_tokens, pages_for, positions_after, shared_pages

__all__ = [  # the page arithmetic (jaxrl_async.paging) stays importable from here for the sampler
    "SCRATCH", "PagePlanner", "PageTable", "SlotPlanner", "mean_resident_tokens", "pages_for",
    "positions_after", "prefix_dest", "shared_pages",
]  # fmt: skip

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


def prefix_dest(table: PageTable, slot: int, prompt_len: int, bucket: int, skip: int) -> np.ndarray:
    """`Engine.insert`'s `dest` for `slot`: int32 [shards, ceil(bucket / page_size)], the page of each
    data shard that receives prompt chunk c (SCRATCH: skipped). Only the slot's shard gets pages, and its
    first `skip` chunks are shared pages another sample of the group already wrote."""
    ps = table.page_size
    dest = np.full((table.shards, pages_for(bucket, ps)), SCRATCH, np.int32)
    pages = table.slot_pages(slot)
    n = min(pages_for(prompt_len, ps), dest.shape[1])
    dest[table.shard_of(slot), skip:n] = pages[skip:n]
    return dest


@dataclasses.dataclass
class _Seq:
    """What the planner knows of a running sequence: numbers only."""

    prompt_len: int
    max_new_tokens: int
    order: int  # admission order (the youngest is preempted first)
    calls: int = 0  # generate calls dispatched since it started


class PagePlanner:
    """The paged cache's page policy over a `PageTable`: admission by memory, placement, growth and the
    choice of sequences to preempt (the caller preempts them).

    A sample is admitted only while its data shard has free pages for its prompt and its first call, on top
    of the pages the running sequences of the shard need for their next call (`room`). Before each call
    `grow` gives every running sequence the pages that call writes; when a shard runs out, waiting groups
    first give up the prompt pages they hold there, then the youngest sequence of the shard is chosen for
    preemption (it has done the least work).

    Group samples share their prompt's full pages: a waiting group holds them as a dict {shard: pages}
    (one reference per shard) that `start` fills and `drop_shared` / `grow` empty.

    Args:
      table: the host page tables.
      steps_per_call: decode steps per generate call (pages are taken one call ahead).
      prompt_bucket: prompt length -> its prefill bucket (the shape of `start`'s `dest`).
      to_device: host table -> its device copy (`device_table`), e.g. a `jax.device_put` with the
        engine's table sharding.
    """

    def __init__(
        self,
        table: PageTable,
        steps_per_call: int,
        prompt_bucket: Callable[[int], int],
        to_device: Callable[[np.ndarray], object],
    ):
        self.table, self.steps_per_call = table, steps_per_call
        self._prompt_bucket, self._to_device = prompt_bucket, to_device
        self._seqs: dict[int, _Seq] = {}  # slot -> running sequence
        self._parked: dict[int, int] = {}  # slot -> admission order of a parked sequence (`park`)
        self._started = 0
        self._device: tuple[int, object] | None = None  # (PageTable.version, device copy of the table)

    # ----- page arithmetic -----

    def first_pages(self, prompt_len: int, max_new_tokens: int) -> int:
        """Pages a newly inserted sample holds: its prompt and its first call's positions."""
        positions = positions_after(prompt_len, max_new_tokens, 1, self.steps_per_call)
        return pages_for(positions, self.table.page_size)

    def next_pages(self, slot: int) -> int:
        """Pages the sequence in `slot` needs for its next call."""
        s = self._seqs[slot]
        positions = positions_after(s.prompt_len, s.max_new_tokens, s.calls + 1, self.steps_per_call)
        return pages_for(positions, self.table.page_size)

    def room(self, shard: int) -> int:
        """Free pages of a shard beyond the next call's growth of the sequences running there."""
        reserve = sum(
            max(0, self.next_pages(b) - len(self.table.slot_pages(b)))
            for b in self._seqs
            if self.table.shard_of(b) == shard
        )
        return self.table.num_free(shard) - reserve

    def group_pages(self, prompt_len: int, max_new_tokens: int, n_samples: int, holds_shared: bool) -> int:
        """New pages `n_samples` samples of a group take (shared prompt pages counted once, and not at all
        when the group holds them already)."""
        n_shared = shared_pages(prompt_len, self.table.page_size)
        private = self.first_pages(prompt_len, max_new_tokens) - n_shared
        return (0 if holds_shared else n_shared) + n_samples * private

    # ----- admission -----

    def free_by_shard(self, free: list[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for b in free:
            out.setdefault(self.table.shard_of(b), []).append(b)
        return out

    def can_admit(self, free: list[int], prompt_len: int, max_new_tokens: int) -> bool:
        """Whether a sample of this shape fits a free slot now."""
        need = self.first_pages(prompt_len, max_new_tokens)
        return any(self.room(shard) >= need for shard in self.free_by_shard(free))

    def admission_room(self, free: list[int]) -> float:
        """Pages the shards with free slots can still give to new samples (the admission budget)."""
        return sum(map(self.room, self.free_by_shard(free)))

    def place(
        self, prompt_len: int, max_new_tokens: int, free: list[int], shared: Collection[int]
    ) -> int | None:
        """A free slot for the next sample of a group in a shard with room, preferring the shards in
        `shared` (where the group holds its prompt pages already), or None."""
        n_shared = shared_pages(prompt_len, self.table.page_size)
        first = self.first_pages(prompt_len, max_new_tokens)
        by_shard = self.free_by_shard(free)
        for shard in sorted(by_shard, key=lambda d: d not in shared):
            if self.room(shard) >= first - (n_shared if shard in shared else 0):
                return by_shard[shard][0]
        return None

    def start(
        self, slot: int, prompt_len: int, max_new_tokens: int, shared: dict, whole: bool = False
    ) -> np.ndarray:
        """Gives a free slot its pages and returns `insert`'s `dest`.

        The first sample of a group in a shard allocates the shared prompt pages and records them in
        `shared` ({shard: pages}, the group's holding); later ones take a reference and skip writing them.

        Args:
          whole: pages for every position the sequence will ever write (benchmarks: no growth later).
        """
        ps, shard = self.table.page_size, self.table.shard_of(slot)
        n_shared = shared_pages(prompt_len, ps)
        held, skip = shared.get(shard), n_shared
        if held is None:  # the first sample in this shard writes the shared pages
            held, skip = self.table.alloc(shard, n_shared), 0
            shared[shard] = held
        if whole:
            total = pages_for(prompt_len + max_new_tokens - 1, ps)
        else:
            total = self.first_pages(prompt_len, max_new_tokens)
        self.table.assign(slot, held, total - n_shared)
        self._started += 1
        self._seqs[slot] = _Seq(prompt_len, max_new_tokens, self._started)
        return prefix_dest(self.table, slot, prompt_len, self._prompt_bucket(prompt_len), skip)

    def extend(self, slot: int, context_len: int, max_new_tokens: int) -> bool:
        """The sequence in `slot` (parked, its pages in place) grows to `context_len` tokens (an
        observation appended) and may generate `max_new_tokens` more: it gets the pages of those positions
        and of its next call, and is planned from now on like a sample inserted with a prompt of
        `context_len` tokens. False (nothing changed) when its shard has too few free pages."""
        if not self.table.grow(slot, self.first_pages(context_len, max_new_tokens)):
            return False
        order = self._parked.pop(slot) if slot in self._parked else self._seqs[slot].order
        self._seqs[slot] = _Seq(context_len, max_new_tokens, order)
        return True

    def park(self, slot: int) -> None:
        """The sequence in `slot` waits for an observation: it keeps its pages, takes no more, and is not
        preempted (its KV is the episode so far)."""
        self._parked[slot] = self._seqs.pop(slot).order

    def dispatched(self) -> None:
        """One generate call was dispatched for every running sequence."""
        for s in self._seqs.values():
            s.calls += 1

    def release(self, slot: int) -> None:
        """The sequence in `slot` ended or was preempted: its references go (idempotent)."""
        self._seqs.pop(slot, None)
        self._parked.pop(slot, None)
        self.table.release(slot)

    def drop_shared(self, shared: dict) -> None:
        """A group lets go of its shared prompt pages (all its samples are in, or its prefix is stale)."""
        for shard, pages in shared.items():
            self.table.decref(shard, pages)
        shared.clear()

    # ----- growth -----

    def grow(self, holders: list[dict]) -> list[int]:
        """Gives every running sequence (oldest first) the pages its next call writes.

        While a shard has too few, the waiting groups' holdings there (`holders`, their `shared` dicts)
        are dropped first (a later sample writes those pages again); then the youngest sequence of the
        shard is released here and returned.

        Returns:
          the slots whose sequences the caller must preempt, in the order they were chosen.
        """
        victims = []
        for _, b in sorted((s.order, b) for b, s in self._seqs.items()):
            while b in self._seqs and not self.table.grow(b, self.next_pages(b)):
                shard = self.table.shard_of(b)
                held = [h for h in holders if shard in h]
                if held:
                    for h in held:
                        self.table.decref(shard, h.pop(shard))
                    continue
                same = [s for s in self._seqs if self.table.shard_of(s) == shard]
                youngest = max(same, key=lambda s: self._seqs[s].order)
                self.release(youngest)
                victims.append(youngest)
        return victims

    # ----- device copy -----

    def device_table(self) -> tuple:
        """The page-table argument of generate / recompute_kv: its device copy, refreshed when it changed."""
        if self._device is None or self._device[0] != self.table.version:
            self._device = (self.table.version, self._to_device(self.table.table.copy()))
        return (self._device[1],)

    def host_table(self) -> tuple:
        """The page-table argument of recompute_kv, which reads it on the host: the host's own copy (the
        device copy of a replica that spans processes is not whole on any of them)."""
        return (self.table.table,)


class SlotPlanner:
    """The slotted cache's policy (same interface as `PagePlanner`): every slot holds `slot_len` positions,
    so a free slot is all a sequence needs; nothing grows, nothing is preempted, there is no table."""

    def can_admit(self, free: list[int], prompt_len: int, max_new_tokens: int) -> bool:
        return bool(free)

    def admission_room(self, free: list[int]) -> float:
        return math.inf

    def group_pages(self, prompt_len: int, max_new_tokens: int, n_samples: int, holds_shared: bool) -> int:
        return 0

    def place(
        self, prompt_len: int, max_new_tokens: int, free: list[int], shared: Collection[int]
    ) -> int | None:
        return free[0] if free else None

    def start(self, slot: int, prompt_len: int, max_new_tokens: int, shared: dict, whole: bool = False):
        return None  # insert takes no `dest`

    def extend(self, slot: int, context_len: int, max_new_tokens: int) -> bool:
        return True

    def park(self, slot: int) -> None:
        pass

    def dispatched(self) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def drop_shared(self, shared: dict) -> None:
        shared.clear()

    def grow(self, holders: list[dict]) -> list[int]:
        return []

    def device_table(self) -> tuple:
        return ()

    def host_table(self) -> tuple:
        return ()
