"""Paths that may be local or in a bucket: a run's workdir, its checkpoints, a model checkpoint, a data file.

A pod's hosts share no disk, so everything a run reads from or promises to leave behind may be a URL
(`gs://bucket/run`, or any scheme etils `epath` understands through fsspec). These helpers go through
`epath` for both kinds; `os.path` would turn `gs://b/run` into the local folder `<cwd>/gs:/b/run`.

Object stores have no append and no rename-in-place: `AppendLog` rewrites the whole object on each write,
and `StagedDir` keeps files that their writer appends to (TensorBoard's event files) in a local staging
folder and copies them to the bucket on each `sync`. Local-only things (sockets, the sandbox's temporary
folders, shared memory) never go through this module.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
import shutil
import tempfile

from etils import epath
from fsspec import config as fsspec_config

log = logging.getLogger(__name__)

# gcsfs caches directory listings, sizes included, per process: a file that another process (or a later
# write) changed then reads back truncated to its old size, and new checkpoint steps go unseen. A pod's
# processes read what others wrote (the ledger, model.json, orbax's step folders), so no listing cache for
# gs:// here; each lookup asks the bucket.
fsspec_config.conf.setdefault("gs", {}).setdefault("use_listings_cache", False)


def is_url(path) -> bool:
    """True for `scheme://...` (a bucket), False for a local path."""
    return "://" in str(path)


def resolve(path: str) -> str:
    """An absolute form of `path`: a local path made absolute (so subprocesses with another cwd agree), a
    URL unchanged."""
    if is_url(path):
        return str(path).rstrip("/")
    return os.path.abspath(os.path.expanduser(path))  # local: as before (symlinks kept as given)


def join(base: str, *parts: str) -> str:
    return str(epath.Path(base).joinpath(*parts))


def path(p: str) -> epath.Path:
    return epath.Path(p)


def makedirs(p: str) -> None:
    """Creates a directory and its parents (a no-op marker-free call on a bucket, which has no folders)."""
    epath.Path(p).mkdir(parents=True, exist_ok=True)


def exists(p: str) -> bool:
    return epath.Path(p).exists()


def isdir(p: str) -> bool:
    return epath.Path(p).is_dir()


def isfile(p: str) -> bool:
    q = epath.Path(p)
    return q.exists() and not q.is_dir()


def read_text(p: str) -> str:
    return epath.Path(p).read_text(encoding="utf-8")


def read_bytes(p: str) -> bytes:
    return epath.Path(p).read_bytes()


def write_text(p: str, text: str) -> None:
    epath.Path(p).write_text(text, encoding="utf-8")


def copy_file(src: str, dst: str) -> None:
    """Copies one file between any two kinds of path (epath's own copy uses the source's backend only)."""
    epath.Path(dst).write_bytes(epath.Path(src).read_bytes())


def _cache_root() -> str:
    # A host-local scratch folder (not a workdir path): $JAXRL_ASYNC_CACHE, else the temporary directory.
    return os.environ.get("JAXRL_ASYNC_CACHE") or os.path.join(tempfile.gettempdir(), "jaxrl_async_remote")


def local_dir(p: str) -> str:
    """A local directory with the files of `p`: `p` itself when local; for a URL (an HF checkpoint or a
    tokenizer in a bucket) a host-local copy of its files (not its subfolders), made once per host and
    reused while each file's size matches. Safetensors are memory-mapped, which needs a local file.
    """
    if not is_url(p):
        return p
    src = epath.Path(p)
    if not src.is_dir():
        raise FileNotFoundError(f"{p}: no such directory")
    dest = epath.Path(_cache_root()) / hashlib.sha256(str(p).rstrip("/").encode()).hexdigest()[:16]
    dest.mkdir(parents=True, exist_ok=True)
    copied = 0
    for f in src.iterdir():
        if f.is_dir():
            continue
        target = dest / f.name
        if target.exists() and target.stat().length == f.stat().length:
            continue
        part = dest / f"{f.name}.{os.getpid()}.part"  # whole or absent: a copy killed midway is not used
        copy_file(str(f), str(part))
        part.rename(target)
        copied += 1
    log.info("%s: %d files copied to %s", p, copied, dest)
    return str(dest)


class AppendLog:
    """A text file that grows by whole lines (the trained-prompt ledger).

    Local: an ordinary append-mode file. A URL: the object's lines (those there already, so a resumed run
    continues the file) are kept in memory and the whole object is rewritten on each `write`, since an
    object store cannot append. Rewriting is cheap at the ledger's size (one line per trained version).
    """

    def __init__(self, p: str):
        self.path, self.remote = p, is_url(p)
        self._lines: list[str] = []
        if self.remote:
            target = epath.Path(p)
            if target.exists():
                self._lines = target.read_text(encoding="utf-8").splitlines(keepends=True)
            self._file = None
        else:
            self._file = epath.Path(p).open("a")  # noqa: SIM115 - closed in close()

    def write(self, line: str) -> None:
        """Appends `line` (newline added) and makes it durable before returning."""
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
            return
        self._lines.append(line + "\n")
        epath.Path(self.path).write_text("".join(self._lines), encoding="utf-8")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class StagedDir:
    """A directory that a library writes to with local file calls (TensorBoard's event writer appends),
    mirrored to `target` when that is a URL.

    `local` is where the writer writes: `target` itself when local; else a fresh local temporary folder
    whose files `sync` copies, whole, to `target` (objects overwritten). `close` syncs a last time and
    removes the staging folder.
    """

    def __init__(self, target: str):
        self.target = target
        self.remote = is_url(target)
        if self.remote:
            self.local = tempfile.mkdtemp(prefix="jaxrl_staged_")
        else:
            makedirs(target)
            self.local = target

    def sync(self) -> int:
        """Copies every staged file to the target; returns how many were copied (0 when local)."""
        if not self.remote:
            return 0
        copied = 0
        root = pathlib.Path(self.local)  # the staging folder is local by construction
        for f in sorted(root.rglob("*")):
            if f.is_file():
                copy_file(str(f), join(self.target, str(f.relative_to(root))))
                copied += 1
        return copied

    def close(self) -> None:
        if self.remote:
            self.sync()
            shutil.rmtree(self.local, ignore_errors=True)
