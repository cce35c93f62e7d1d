"""JAX's persistent compilation cache (config.compile_cache_dir): a rerun, a restart after a kill or a resume
with the same shapes loads its compiled programs from disk instead of compiling them again.

On letter_range's one-process run (2-core CPU) the first step ended 12.1 s after the start with no cache and
3.8 s with a warm one (docs/history/benchmarks.md, "Start-up, and a warm compile cache"). Every compile is
cached, however short: JAX's default skips those under a second, which on CPU is most of them (it kept 3
of 58).

JAX runs what it loads from the cache, so the cache is code: anyone who can write to the directory can run
code in every process that reads it (JAX's own warning). `enable` therefore refuses a directory that another
user owns or that its group or others may write, and creates a missing one private to this user.

JAX writes entries from process 0 only (its rule, against write contention on shared file systems): in a
multi-process run the other processes load what a process 0 wrote for the same program and add nothing. A
trainer process runs process 0's programs, so that is enough for it; a sampler process runs programs of its
own, which JAX would compile in every run (18 programs, 8 s of its core, on letter_range). So a process other
than 0 keeps its sampler engines' executables itself (`ExecutableStore`, in the directory's `executables/`):
serialized after their ahead-of-time compile, loaded by the next run. It serves a replica within one process
and a local directory; a replica that spans processes and a URL use JAX's cache alone.

JAX writes an entry in place, not by rename, so a process killed while writing can leave a truncated one:
JAX then warns, compiles that program and never rewrites it. The store writes by rename and rewrites an
entry it cannot load. Deleting the directory clears both. `CacheUse` counts what the cache did in each
process through JAX's monitoring events (compiles that asked it, and hits) and the store's own counts, and
the run logs it per process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import pickle
import stat
import tempfile
import threading

log = logging.getLogger(__name__)

_REQUEST = "/jax/compilation_cache/compile_requests_use_cache"
_HIT = "/jax/compilation_cache/cache_hits"


class _Counts:
    """Process-wide counts of the two events (JAX's listeners are process-wide; registered once)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.hits = 0
        self.registered = False

    def on_event(self, event: str, **_) -> None:
        if event in (_REQUEST, _HIT):
            with self.lock:
                if event == _REQUEST:
                    self.requests += 1
                else:
                    self.hits += 1

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.requests, self.hits


_COUNTS = _Counts()


class CacheError(ValueError):
    """The directory cannot be trusted or used (the message names config.compile_cache_dir)."""


def check_dir(path: str) -> str:
    """The absolute directory for `path` (~ expanded), created private to this user if missing. A URL
    ("gs://bucket/xla": one cache for every host of a pod) passes as it is: its access is the bucket's.

    Raises:
      CacheError: it is not a directory, another user owns it, or its group or others may write to it.
    """
    if "://" in path:
        return path
    path = os.path.abspath(os.path.expanduser(path))
    field = f"config.compile_cache_dir={path!r}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise CacheError(f"{field}: not a directory")
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise CacheError(f"{field}: cannot create or read it ({e})") from None
    if st.st_uid != os.getuid():
        raise CacheError(f"{field}: owned by uid {st.st_uid}, not this user ({os.getuid()}); JAX runs the "
                         "programs it loads from the cache, so use a directory of your own")  # fmt: skip
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(f"{field}: its group or others may write to it (mode {stat.S_IMODE(st.st_mode):o}); "
                         "JAX runs the programs it loads from the cache, so use a directory only you can "
                         "write (chmod go-w)")  # fmt: skip
    return path


def _entries(path: str) -> int | None:
    """JAX's entries (files; the store's `executables/` is counted by the store)."""
    if "://" in path:
        return None  # not counted remotely
    return sum(1 for e in os.scandir(path) if not e.name.startswith(".") and e.is_file())


def _host_isa() -> str:
    """The CPU's feature flags: an XLA:CPU executable is compiled for the host's instruction set, and a cache
    directory may be shared by hosts of different CPUs."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def program_key(lowered, ident: str) -> str:
    """The store's key of a program: sha256 of `ident` (versions, platform, devices, host flags) and the
    program's StableHLO text, which `ExecutableStore` prints and hashes for every program at every start
    (the plan check times it on a config's `generate`)."""
    return hashlib.sha256(ident.encode() + b"\0" + lowered.as_text().encode()).hexdigest()


class ExecutableStore:
    """Serialized executables of this process's ahead-of-time compiles, one file per program, for a process
    JAX writes no cache entries for (see the module doc). The key hashes the program's StableHLO (shardings
    and donation included), its devices, the JAX and jaxlib versions, the platform and the host's CPU
    flags, and XLA_FLAGS; an entry that does not load is compiled again and rewritten."""

    def __init__(self, path: str):
        self.path = check_dir(path)
        self.loaded = self.compiled = self.written = 0
        self._salt = repr((importlib.metadata.version("jax"), importlib.metadata.version("jaxlib"),
                           os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                           _host_isa()))  # fmt: skip

    def compiler(self, devices):
        """A `compile_fn` for an engine whose programs run on `devices` (in the mesh's order): all of them
        this process's own."""
        devices = tuple(devices)
        return lambda lowered: self.compile(lowered, devices)

    def compile(self, lowered, devices: tuple):
        """The executable of `lowered` (a `jax.stages.Lowered`), loaded from the store or compiled and
        stored."""
        from jax.experimental import serialize_executable

        client = devices[0].client
        ident = repr((self._salt, client.platform, client.platform_version, devices[0].device_kind,
                      [d.id for d in devices]))  # fmt: skip
        file = os.path.join(self.path, f"{program_key(lowered, ident)}.exe")
        if os.path.exists(file):
            try:
                with open(file, "rb") as f:  # a directory only this user may write (check_dir)
                    payload, in_tree, out_tree = pickle.load(f)
                exe = serialize_executable.deserialize_and_load(payload, in_tree, out_tree, client, devices)
                self.loaded += 1
                return exe
            except Exception as e:  # noqa: BLE001 - truncated, or from another build: compile it again
                log.warning("executable store: %s did not load (%s: %s); compiling it again",
                            file, type(e).__name__, e)  # fmt: skip
        exe = lowered.compile()
        self.compiled += 1
        try:
            blob = pickle.dumps(serialize_executable.serialize(exe))
        except (ValueError, NotImplementedError) as e:  # e.g. a backend that cannot serialize
            log.warning("executable store: not kept (%s)", e)
            return exe
        tmp = None
        try:
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".tmp-", delete=False) as f:
                tmp = f.name
                f.write(blob)
            os.replace(tmp, file)  # whole or absent, never truncated
            self.written += 1
        except OSError as e:  # a full or read-only disk costs the next run a compile, not this run
            log.warning("executable store: %s not kept (%s)", file, e)
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
        return exe

    def report(self) -> dict:
        return {"dir": self.path, "loaded": self.loaded, "compiled": self.compiled, "written": self.written}


@dataclasses.dataclass
class CacheUse:
    """What the cache did in this process since `enable`: its directory, how many entries it held then,
    and (read by `report`) how many compiles asked it and how many it answered."""

    dir: str
    entries_at_start: int | None  # None: a remote cache (not counted)
    _start: tuple[int, int]
    store: ExecutableStore | None = None  # a local directory, in a process other than 0

    def report(self) -> dict:
        requests, hits = (now - then for now, then in zip(_COUNTS.snapshot(), self._start, strict=True))
        return {"dir": self.dir, "compiles": requests, "loaded": hits,
                "entries_at_start": self.entries_at_start, "entries_at_end": _entries(self.dir),
                "executables": self.store and self.store.report()}  # fmt: skip

    def log_line(self) -> str:
        r = self.report()
        if r["compiles"] == 0:
            line = f"compile cache {r['dir']}: no compile in this process asked it"
        else:
            line = f"compile cache {r['dir']}: {r['loaded']} of {r['compiles']} compiles loaded from it"
            if r["entries_at_end"] is not None:
                added = r["entries_at_end"] - r["entries_at_start"]
                line += f", {added} entries added ({r['entries_at_end']} now)"
        if self.store is not None:  # a process other than 0, which JAX writes nothing for
            x = r["executables"]
            line += (f"; the sampler's own executables: {x['loaded']} loaded, {x['compiled']} compiled, "
                     f"{x['written']} kept")  # fmt: skip
        return line


def enable(path: str) -> CacheUse:
    """Makes every later compile of this process read and write the cache at `path` (see the module doc)."""
    import jax
    import jax.monitoring

    path = check_dir(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    with _COUNTS.lock:
        register, _COUNTS.registered = not _COUNTS.registered, True
    if register:
        jax.monitoring.register_event_listener(_COUNTS.on_event)
    store = None
    if jax.process_index() != 0 and "://" not in path:
        store = ExecutableStore(os.path.join(path, "executables"))
    use = CacheUse(path, _entries(path), _COUNTS.snapshot(), store)
    n = use.entries_at_start
    log.info("compile cache %s%s", path, "" if n is None else f": {n} entries")
    return use
