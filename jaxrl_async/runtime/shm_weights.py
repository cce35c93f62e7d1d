"""Weights between processes of one CPU host: one copy per version, through shared-memory slots.

Why: between two processes on a CPU host the transfer server moves about a tenth of what a memcpy into warm
memory does (docs/history/benchmarks.md). Processes of one host share memory, so a version needs one copy:
each trainer process writes its pieces (`weight_sync._PiecePlan`) into a slot, a file under /dev/shm whose
pages were touched when the slot was made, and every sampler process on the host turns the pieces of its
own blocks into JAX arrays in place (`jax.device_put` of an aligned numpy array is zero-copy on the CPU
backend), so the receiving side copies nothing.

Slots are reused, never overwritten under a reader:
* a receiver holds a slot while any JAX array made from it lives: a finalizer on each numpy view it hands
  to `jax.device_put` tells it when JAX has dropped the view (after the last computation that read it);
* the writer takes a slot only when every reader has started every version it held (`started`) and holds
  none of its pieces (`held`). A reader that needs a version it was told of always finds it;
* at most `max_slots` versions sit in shared memory. When every slot is held the writer waits (so memory
  stays bounded), says who holds them after 5 s and every minute, and fails with their names after
  `timeout_s` (30 minutes: a long evaluation holds its version; a dead reader fails it at once).

The control block (int64: the version in each slot, then `held` per reader and slot, then `started` per
reader) is read and written under an flock of its file, which orders one side's checks against the other's
writes. A reader's finalizers store its new counts at once (one aligned word each, so the writer never
waits on a slot that is already free); an RLock orders them against `take` in the reader's process.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager

import numpy as np

from jaxrl_async.runtime.cluster import PeerFailure

log = logging.getLogger(__name__)

SHM_ROOT = "/dev/shm"  # tmpfs on Linux; where it is missing (macOS) every pull takes the transfer server
ALIGN = 64  # bytes; XLA:CPU adopts a host buffer without a copy only when it is aligned
PREFIX = "jaxrl_async-weights-"  # + the writer's OS pid + "-" + a unique tail
MAX_SLOTS = 4  # versions in shared memory at most: one sampled, one on its way, one an eval holds, a spare


def host_key() -> str:
    """Which host and memory this process is on: processes with equal keys share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def alive(pid: int) -> bool:
    """Whether OS process `pid` runs (a zombie does not: it is dead until its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def writer_pid(directory: str) -> int:
    """The OS pid of the process whose slots `directory` holds (it is in the name)."""
    return int(os.path.basename(directory)[len(PREFIX) :].partition("-")[0])


def _sweep() -> None:
    """Removes the slots of writers that died without closing (killed runs), so they do not pile up."""
    for name in os.listdir(SHM_ROOT):
        head, _, rest = name.partition(PREFIX)
        pid = rest.partition("-")[0]
        if not head and pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(os.path.join(SHM_ROOT, name), ignore_errors=True)


def layout(shapes: list[tuple], itemsize: int) -> tuple[list[int], int]:
    """Each piece's byte offset in a slot (aligned) and the slot's size."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-int(np.prod(shape)) * itemsize // ALIGN) * ALIGN
    return offsets, max(end, ALIGN)


class _Control:
    """The control block of one writer's slots, shared by the writer and its readers."""

    def __init__(self, directory: str, max_slots: int, readers: int | None = None):
        create = readers is not None  # the writer makes it; a reader reads its size from the file
        path = os.path.join(directory, "control")
        self.fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        if create:  # stamps, held, started, the readers' OS pids
            os.ftruncate(self.fd, (max_slots + readers * (max_slots + 2)) * 8)
        n = os.fstat(self.fd).st_size // 8
        readers = (n - max_slots) // (max_slots + 2)
        self.readers, self.max_slots = readers, max_slots
        self.map = mmap.mmap(self.fd, n * 8)
        words = np.ndarray((n,), np.int64, buffer=self.map)
        self.stamp = words[:max_slots]  # the version in each slot; -1: empty or being written
        self.held = words[max_slots : max_slots + readers * max_slots].reshape(readers, max_slots)
        rest = words[max_slots + readers * max_slots :]
        self.started = rest[:readers]  # the newest version each reader started
        self.pids = rest[readers:]  # each reader's OS pid (0: not connected)
        if create:
            words[:] = -1
            self.held[:] = 0
            self.pids[:] = 0

    @contextmanager
    def locked(self):
        import fcntl

        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)


def _open_slot(directory: str, slot: int, nbytes: int, create: bool) -> mmap.mmap:
    fd = os.open(os.path.join(directory, f"slot{slot}"), os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


class SlotWriter:
    """A trainer process's side: writes each version's pieces into a free slot, one memcpy per piece.

    Args:
      shapes, dtype: the pieces this process offers, in order (the readers derive the same list).
      readers: how many pulls take each version; `shm_readers` those of them that read the slots.
      check: called while waiting for a slot (e.g. the cluster's peer check: a dead reader ends the wait).
    """

    def __init__(self, shapes: list[tuple], dtype, readers: int, shm_readers: list[int], *,
                 max_slots: int = MAX_SLOTS, timeout_s: float = 1800.0, check=None):  # fmt: skip
        self.shapes, self.dtype = [tuple(s) for s in shapes], np.dtype(dtype)
        self.offsets, self.nbytes = layout(self.shapes, self.dtype.itemsize)
        _sweep()
        self.directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=SHM_ROOT)
        self.ctrl = _Control(self.directory, max_slots, readers)
        self.shm_readers = list(shm_readers)
        self.timeout_s, self.check = timeout_s, check
        self.slots: dict[int, mmap.mmap] = {}
        self.last_wait_s = 0.0
        for slot in range(min(2, max_slots)):  # made now: the run's first versions pay no page faults
            self._make(slot)

    def write(self, version: int, sources) -> int:
        """Writes `version`'s pieces (numpy arrays or views, in `shapes` order) into a free slot and
        returns the slot; the readers find it there from the moment this returns."""
        slot = self._claim(version)
        buf = self.slots[slot]
        for off, shape, src in zip(self.offsets, self.shapes, sources, strict=True):
            dst = np.ndarray(shape, self.dtype, buffer=buf, offset=off)
            if src.dtype != self.dtype and src.dtype.itemsize == self.dtype.itemsize:
                dst = dst.view(src.dtype)  # the bits of a dtype numpy cannot take from JAX (bfloat16)
            np.copyto(dst, src, casting="no")
        with self.ctrl.locked():
            self.ctrl.stamp[slot] = version
        return slot

    def _claim(self, version: int) -> int:
        """A slot no reader holds or still has to start (its stamp set to -1 under the lock)."""
        t0 = time.monotonic()
        warn_at = 5.0
        while True:
            with self.ctrl.locked():
                free = self._free()
                if free is not None:
                    self.ctrl.stamp[free] = -1
                    break
            waited = time.monotonic() - t0
            if self.check is not None:
                self.check()
            pids = {r: int(self.ctrl.pids[r]) for r in self.shm_readers}
            gone = {r: pid for r, pid in pids.items() if pid > 0 and not alive(pid)}
            if gone:
                raise PeerFailure(f"weights: the sampler processes of pulls {sorted(gone)} (OS pids "
                                  f"{sorted(gone.values())}) are gone")  # fmt: skip
            if waited > self.timeout_s:
                raise TimeoutError(f"weights: no shared-memory slot for version {version} within "
                                   f"{self.timeout_s:.0f} s: {self._holders()}")  # fmt: skip
            if waited > warn_at:
                log.warning("weights: version %d waits for a shared-memory slot: %s", version,
                            self._holders())  # fmt: skip
                warn_at = waited + 60.0
            time.sleep(0.001)
        self.last_wait_s = time.monotonic() - t0
        if free not in self.slots:
            self._make(free)
        return free

    def _make(self, slot: int) -> None:
        """A new slot, its pages touched once here rather than by every version written into it."""
        self.slots[slot] = _open_slot(self.directory, slot, self.nbytes, create=True)
        np.ndarray((self.nbytes,), np.uint8, buffer=self.slots[slot])[:] = 0

    def _free(self) -> int | None:
        """The free slot of the oldest version; a slot not made yet only when no made one is free."""
        c = self.ctrl
        free = [(int(c.stamp[s]), s) for s in self.slots
                if not any(c.held[r, s] for r in self.shm_readers)
                and all(c.started[r] >= c.stamp[s] for r in self.shm_readers)]  # fmt: skip
        if free:
            return min(free)[1]
        unmade = [s for s in range(c.max_slots) if s not in self.slots]
        return unmade[0] if unmade else None

    def _holders(self) -> str:
        c = self.ctrl
        parts = [
            f"slot {s} (version {int(c.stamp[s])}) held by readers "
            f"{[r for r in self.shm_readers if c.held[r, s]]}, not yet started by "
            f"{[r for r in self.shm_readers if c.started[r] < c.stamp[s]]}"
            for s in sorted(self.slots)
        ]
        return "; ".join(parts) + " (an evaluation keeps its version's weights: see config.eval_weights)"

    def close(self) -> None:
        """Removes the slots' files (readers that still map them keep their pages until they let go)."""
        shutil.rmtree(self.directory, ignore_errors=True)


class SlotReader:
    """A sampler process's side of one writer: maps the pieces it takes, without copying them."""

    def __init__(self, directory: str, shapes: list[tuple], dtype, reader: int, *, max_slots: int = MAX_SLOTS,
                 timeout_s: float = 300.0, check=None):  # fmt: skip
        self.directory, self.reader, self.timeout_s, self.check = directory, reader, timeout_s, check
        self.shapes, self.dtype = [tuple(s) for s in shapes], np.dtype(dtype)
        self.offsets, self.nbytes = layout(self.shapes, self.dtype.itemsize)
        self.ctrl = _Control(directory, max_slots)
        self.slots: dict[int, mmap.mmap] = {}
        self._held = [0] * max_slots  # live views per slot
        self._lock = threading.RLock()  # finalizers run on whichever thread drops the last reference
        self.writer_pid = writer_pid(directory)
        self.ctrl.pids[reader] = os.getpid()

    def take(self, version: int, wanted: list[int]) -> list[np.ndarray]:
        """Views of pieces `wanted` (positions in `shapes`) of `version`, straight on the slot's pages; the
        slot stays held until every view is gone (hand them to `jax.device_put`, which keeps them)."""
        gc.collect(0)  # JAX hands back the host buffers of dropped arrays from a gc callback: run it now
        c = self.ctrl
        t0 = time.monotonic()
        while True:  # the writer stamps a version before its message is sent; a reader told early waits
            with c.locked():
                slots = [s for s in range(c.max_slots) if c.stamp[s] == version]
                if slots:
                    self._add(slots[0], len(wanted))
                    c.started[self.reader] = max(int(c.started[self.reader]), version)
                    break
            if not alive(self.writer_pid):  # a writer that died mid-version never stamps it
                shutil.rmtree(self.directory, ignore_errors=True)  # nobody else will remove its slots
                raise PeerFailure(f"weights: the trainer process writing version {version} (OS pid "
                                  f"{self.writer_pid}) is gone")  # fmt: skip
            if time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"weights: version {version} did not appear in shared memory "
                                   f"({self.directory}) within {self.timeout_s:.0f} s")  # fmt: skip
            if self.check is not None:
                self.check()
            time.sleep(0.001)
        slot = slots[0]
        if slot not in self.slots:
            self.slots[slot] = _open_slot(self.directory, slot, self.nbytes, create=False)
        views = []
        for i in wanted:
            v = np.ndarray(self.shapes[i], self.dtype, buffer=self.slots[slot], offset=self.offsets[i])
            weakref.finalize(v, self._add, slot, -1)
            views.append(v)
        return views

    def _add(self, slot: int, n: int) -> None:
        with self._lock:
            self._held[slot] += n
            self.ctrl.held[self.reader, slot] = self._held[slot]
