"""The minimal filesystem view of a sandboxed program: a private root that holds only what it needs.

The root is a small tmpfs, made read-only once built, holding:
  * the interpreter's files, bound read-only at their host paths: its executable, the directories on
    its `sys.path` (standard library, lib-dynload, site-packages), the directories of the shared
    objects it maps, and the symlinks on the way to each (e.g. `/lib64 -> usr/lib64` for the ELF
    loader);
  * `/dev/{null,zero,random,urandom}` (bound from the host) and `/dev/{fd,stdin,stdout,stderr}` links;
  * `/proc`: a fresh procfs mounted `hidepid=invisible,subset=pid`, so it lists only the processes
    the program may ptrace, i.e. those of its own run uid, and none of the host's `/proc/sys`, ... files;
  * `/sandbox`: the run's working directory (read-write, noexec).

`plan_for(python)` works out the layout once per interpreter, outside the sandbox; `enter(plan, ...)`
builds it in the child between `unshare(CLONE_NEWNS)` and the uid drop, then pivots into it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import os
import platform
import struct
import subprocess

SANDBOX_DIR = "/sandbox"
HARNESS_DIR = "/harness"
_RESERVED = ("/dev", "/proc", SANDBOX_DIR, HARNESS_DIR)
_DEVICES = ("null", "zero", "random", "urandom")
_DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
              ("stderr", "/proc/self/fd/2"))
# Per-mount procfs options exist since Linux 5.8; older kernels know only "hidepid=2" (same effect for
# processes, the host's /proc files stay visible).
_PROC_OPTIONS = (b"hidepid=invisible,subset=pid", b"hidepid=2")
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
# What the interpreter maps once it has imported what the grading harness imports.
_PROBE = (
    "import ctypes, json, os, signal, sys, types\n"
    "maps = sorted({l.split()[5] for l in open('/proc/self/maps') if len(l.split()) > 5 "
    "and l.split()[5].startswith('/')})\n"
    "print(json.dumps({'executable': os.path.realpath(sys.executable), 'path': sys.path, 'maps': maps}))\n"
)


@dataclasses.dataclass(frozen=True)
class RootPlan:
    """The layout of one interpreter's sandbox root (paths are absolute, the same inside and on the host).

    Attributes:
      python: the interpreter's real path, the one to exec.
      dirs: directories to create in the root (parents first).
      files: empty files to create as mount points for bound files.
      symlinks: (path, target) links copied from the host.
      binds: host paths bound read-only at the same path.
    """

    python: str
    dirs: tuple[str, ...]
    files: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...]
    binds: tuple[str, ...]

    def top_level(self) -> set[str]:
        """Names a program sees when it lists `/`."""
        names = {"dev", "proc", SANDBOX_DIR.strip("/")}
        for p in (*self.dirs, *self.files, *(link for link, _ in self.symlinks)):
            names.add(p.strip("/").split("/")[0])
        return names


def _elf_interpreter(path: str) -> str | None:
    """The PT_INTERP path (the dynamic loader) of a 64-bit little-endian ELF, else None."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            return None
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
        for i in range(phnum):
            p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    return None


def _collapse(paths) -> tuple[str, ...]:
    """Drops paths that lie inside another path of the set (binding the outer one covers them)."""
    out: list[str] = []
    for p in sorted(set(paths)):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return tuple(out)


class _Builder:
    """Accumulates the dirs, files and symlinks that make each needed path resolve inside the root."""

    def __init__(self, binds: tuple[str, ...]):
        self.binds = binds
        self.dirs: list[str] = []
        self.files: list[str] = []
        self.symlinks: dict[str, str] = {}

    def _bound(self, path: str) -> str | None:
        for b in self.binds:
            if path == b or path.startswith(b.rstrip("/") + "/"):
                return b
        return None

    def reach(self, path: str, depth: int = 0):
        """Makes `path` resolve in the root: copies each symlink on the way and creates mount points."""
        if depth > 32:
            raise OSError(f"fsview: too many symlinks resolving {path}")
        parts = [p for p in os.path.normpath(path).split("/") if p]
        cur = "/"
        for i, part in enumerate(parts):
            nxt = os.path.join(cur, part)
            bound = self._bound(nxt)
            if bound is not None:
                if bound == nxt:
                    (self.dirs if os.path.isdir(nxt) else self.files).append(nxt)
                    # Its parent directories exist by now; the bind provides the rest.
                    rest = parts[i + 1 :]
                    if rest:
                        real = os.path.realpath(os.path.join(nxt, *rest))
                        if not self._bound(real):
                            self.reach(real, depth + 1)
                return
            if os.path.islink(nxt):
                target = os.readlink(nxt)
                self.symlinks[nxt] = target
                resolved = os.path.normpath(os.path.join(cur, target))
                self.reach(os.path.join(resolved, *parts[i + 1 :]), depth + 1)
                return
            if i < len(parts) - 1 or os.path.isdir(nxt):
                self.dirs.append(nxt)
            cur = nxt


@functools.cache
def plan_for(python: str, env: tuple[tuple[str, str], ...]) -> RootPlan:
    """Works out the root an interpreter needs by running it once, outside any sandbox, with the
    sandbox's environment `env` (its locale decides which locale files get mapped).

    Raises:
      OSError: the interpreter did not run or reported nothing usable.
    """
    try:
        out = subprocess.run([python, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=60,
                             env=dict(env))
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"fsview: cannot run {python}: {e!r}") from e
    if out.returncode != 0:
        raise OSError(f"fsview: probing {python} failed: {out.stderr.strip()[-300:]}")
    info = json.loads(out.stdout)
    exe = info["executable"]
    lib_dirs = {os.path.dirname(m) for m in info["maps"] if os.path.exists(m) and m != exe}
    path_dirs = {os.path.realpath(p) for p in info["path"] if p and os.path.isdir(p)}
    binds = _collapse([exe, *path_dirs, *lib_dirs])
    b = _Builder(binds)
    loader = _elf_interpreter(exe)
    for p in (exe, python, *(p for p in info["path"] if p and os.path.isdir(p)), *binds,
              *([loader] if loader else [])):
        b.reach(p)
    dirs = tuple(dict.fromkeys(d for d in sorted(b.dirs, key=lambda d: d.count("/"))))
    for path in (*dirs, *b.files, *b.symlinks):
        clash = next((r for r in _RESERVED if path == r or path.startswith(r + "/")), None)
        if clash:
            raise OSError(f"fsview: {python} needs {path}, which the sandbox uses for {clash}")
    return RootPlan(
        python=exe,
        dirs=dirs,
        files=tuple(dict.fromkeys(b.files)),
        symlinks=tuple(sorted(b.symlinks.items())),
        binds=binds,
    )


def libc():
    """The C library, with errno kept for `check`."""
    return ctypes.CDLL(None, use_errno=True)


def check(rc: int, what: str):
    """Raises OSError (with errno's message) when a libc call returned non-zero."""
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def make_private(lib):
    """Stops mount events propagating between this (new) mount namespace and the host's."""
    check(lib.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")


def _bind(lib, src: str, dst: str, flags: int):
    """Bind-mounts src on dst, then remounts the bind with `flags` (the remount's result is checked)."""
    check(lib.mount(src.encode(), dst.encode(), None, _MS_BIND, None), f"bind {src}")
    check(lib.mount(None, dst.encode(), None, _MS_REMOUNT | _MS_BIND | flags, None), f"remount {dst}")


def readonly_host(lib, workdir: str):
    """The fallback view: every host mount except `workdir` (bound onto itself first) made read-only;
    raises OSError when any remount fails."""
    check(lib.mount(workdir.encode(), workdir.encode(), None, _MS_BIND, None), "bind workdir")
    with open("/proc/self/mountinfo") as f:
        mounts = [(line.split()[4], line.split()[5].split(",")) for line in f]
    for point, opts in mounts:
        if point == workdir or point.startswith(("/proc", "/sys", "/dev/pts")):
            continue
        # A bind remount must restate the locked flags or the kernel refuses it.
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        flags |= _MS_NOSUID if "nosuid" in opts else 0
        flags |= _MS_NODEV if "nodev" in opts else 0
        flags |= _MS_NOEXEC if "noexec" in opts else 0
        check(lib.mount(None, point.encode(), None, flags, None), f"remount {point} read-only")


def enter(plan: RootPlan, mountpoint: str, workdir: str, harness_dir: str | None = None):
    """Builds the root on `mountpoint` (an empty host dir) and pivots into it; cwd ends at SANDBOX_DIR.
    `harness_dir`, when given, is bound read-only at HARNESS_DIR.

    Runs in the sandbox child, inside a private mount namespace whose mounts are already private, as
    root and before the uid drop. Every mount is checked: a failure raises OSError.
    """
    syscall = _SYS_PIVOT_ROOT.get(platform.machine())
    if syscall is None:
        raise OSError(f"fsview: pivot_root syscall number unknown for {platform.machine()}")
    lib = libc()
    check(lib.mount(b"tmpfs", mountpoint.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                      b"size=1m,nr_inodes=4096,mode=0755"), "mount tmpfs root")
    root = lambda p: mountpoint + p
    # plan.dirs lists parents first and the tmpfs is empty: plain mkdir is enough (and cheaper).
    for d in (*plan.dirs, "/dev", "/proc", SANDBOX_DIR, *([HARNESS_DIR] if harness_dir else [])):
        os.mkdir(root(d), 0o755)
    for f in (*plan.files, *(f"/dev/{d}" for d in _DEVICES)):
        os.close(os.open(root(f), os.O_CREAT | os.O_WRONLY, 0o644))
    for link, target in plan.symlinks:
        os.symlink(target, root(link))
    for name, target in _DEV_LINKS:
        os.symlink(target, root(f"/dev/{name}"))
    for path in plan.binds:
        _bind(lib, path, root(path), _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    for d in _DEVICES:
        _bind(lib, f"/dev/{d}", root(f"/dev/{d}"), _MS_NOSUID | _MS_NOEXEC)
    _bind(lib, workdir, root(SANDBOX_DIR), _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    if harness_dir:
        _bind(lib, harness_dir, root(HARNESS_DIR), _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    proc, flags = root("/proc").encode(), _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
    if all(lib.mount(b"proc", proc, b"proc", flags, opts) != 0 for opts in _PROC_OPTIONS):
        check(1, "mount /proc with hidepid")
    os.chdir(mountpoint)
    check(lib.syscall(syscall, b".", b"."), "pivot_root")
    check(lib.umount2(b".", _MNT_DETACH), "detach the old root")
    check(lib.mount(None, b"/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None),
           "remount the root read-only")
    os.chdir(SANDBOX_DIR)
