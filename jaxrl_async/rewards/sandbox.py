"""Run untrusted Python programs in a contained subprocess (temp dir, rlimits, no network, kill on timeout).

Layers, each used when the kernel and our privileges allow it (see `capabilities()`):
  * always: own temp working dir, scrubbed environment, `python -I`, new session, CPU / address-space /
    process / file-size / open-file rlimits, wall-clock timeout that SIGKILLs the whole process group,
    stdout/stderr capped (the program is killed when it exceeds the cap);
  * `uid`: the program runs under a fresh unprivileged uid (root only), so RLIMIT_NPROC bites, it cannot
    signal its parent, read the parent's `/proc/<pid>/environ` or write files it does not own, and every
    process it leaves behind (even ones that called setsid) is found by that uid in /proc and killed;
  * `netns`: a private network namespace (no interfaces up, so every connect fails);
  * `mountns`: a private mount namespace where every mount except the working dir is read-only.
Without `netns` a Python audit hook refuses socket connect/bind/sendto (a weaker guard: code that
reaches libc through ctypes gets past it).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import itertools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
# Each run gets uid BASE + 256 * launcher pid + (run counter % 256): unique among live launchers, fresh
# for each run (killed processes may linger as zombies and count against the next run's RLIMIT_NPROC),
# and far above any uid a real account uses (pids < 2**22, so uids stay below 2**32 - 1).
_UID_BASE = 1_500_000_000
_run_counter = itertools.count()
_PATH = "/usr/local/bin:/usr/bin:/bin"
_RUN_LOCK = threading.Lock()
_SOCKET_GUARD = (
    "import sys\n"
    "def _guard(event, args):\n"
    "    if event in ('socket.connect', 'socket.bind', 'socket.sendto', 'socket.sendmsg'):\n"
    "        raise PermissionError('network access is disabled in the sandbox')\n"
    "sys.addaudithook(_guard)\n"
    "del _guard\n"
)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run.

    Attributes:
      timeout_s: wall-clock limit; the whole process group (and the run's uid) is SIGKILLed after it.
      cpu_s: RLIMIT_CPU in seconds.
      memory_mb: RLIMIT_AS (address space) in MiB.
      max_processes: RLIMIT_NPROC (processes and threads of the run's uid; only enforced off root).
      max_file_mb: RLIMIT_FSIZE in MiB (largest file the program may write).
      max_open_files: RLIMIT_NOFILE.
      max_output_bytes: cap on stdout and stderr each; exceeding it kills the program.
      isolation: "auto" uses every layer that works here; "strict" raises if uid/netns/mountns fail.
      python: interpreter for the program; None picks the first of sys.executable, /usr/bin/python3
        that the sandboxed uid can run.
    """

    timeout_s: float = 5.0
    cpu_s: int = 5
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    max_open_files: int = 64
    max_output_bytes: int = 1 << 20
    isolation: str = "auto"
    python: str | None = None

    def __post_init__(self):
        if self.timeout_s <= 0 or self.cpu_s <= 0:
            raise ValueError("SandboxLimits: timeout_s and cpu_s must be positive")
        for name in ("memory_mb", "max_processes", "max_file_mb", "max_open_files", "max_output_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SandboxLimits: {name} must be >= 1")
        if self.isolation not in ("auto", "strict"):
            raise ValueError(f"SandboxLimits: isolation must be 'auto' or 'strict', got {self.isolation!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """Outcome of one run; `status` is ok | exit_nonzero | timeout | cpu_limit | memory_limit |
    output_limit | signal | launch_error."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Which isolation layers work in this process (probed once)."""

    uid: bool
    netns: bool
    mountns: bool
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        layers = [n for n in ("uid", "netns", "mountns") if getattr(self, n)]
        net = "private network namespace" if self.netns else "audit-hook socket guard (bypassable)"
        return f"layers={layers or ['rlimits only']}; network: {net}; " + "; ".join(self.notes)


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _readonly_mounts(libc, workdir: str):
    """Makes every mount except `workdir` (bound onto itself first) read-only in this mount namespace."""
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND, None), "bind workdir")
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
        libc.mount(None, point.encode(), None, flags, None)


def _child_setup(workdir: str, limits: SandboxLimits, uid: int | None, netns: bool, mountns: bool):
    """Runs in the forked child before exec: namespaces, rlimits, then the uid drop (order matters)."""
    libc = _libc() if (netns or mountns) else None
    if netns or mountns:
        _check(libc.unshare((_CLONE_NEWNET if netns else 0) | (_CLONE_NEWNS if mountns else 0)), "unshare")
    if mountns:
        _readonly_mounts(libc, workdir)
    # The cwd set by Popen points at the directory under the now read-only root; re-enter the bind mount.
    os.chdir(workdir)
    mb = 1 << 20
    # CPU: soft < hard so the program gets SIGXCPU (reported as cpu_limit) before the hard SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    for res, val in (
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.max_file_mb * mb),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
        (resource.RLIMIT_NPROC, limits.max_processes),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(res, (val, val))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)


def _spawn(argv, workdir, env, limits, uid, netns, mountns, stdin_file):
    return subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdin=stdin_file,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
        preexec_fn=functools.partial(_child_setup, workdir, limits, uid, netns, mountns),
    )


def _communicate(proc: subprocess.Popen, limits: SandboxLimits):
    """Reads capped stdout/stderr until exit or a limit; returns (out, err, why_killed)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.timeout_s
    why = None

    def read_ready(timeout: float) -> tuple[bool, bool]:
        """Reads what is ready; returns (any stream still open, anything was ready)."""
        events = sel.select(timeout=timeout)
        for key, _ in events:
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf += chunk[: limits.max_output_bytes + 1 - len(buf)]
        return bool(sel.get_map()), bool(events)

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        streams_open, _ = read_ready(min(left, 0.05))
        if any(len(b) > limits.max_output_bytes for b in bufs.values()):
            why = "output_limit"
            break
        # The main process decides the outcome; a leftover child holding the pipes open is killed after.
        if not streams_open or proc.poll() is not None:
            while streams_open and all(len(b) <= limits.max_output_bytes for b in bufs.values()):
                streams_open, ready = read_ready(0)
                if not ready:
                    break
            break
    sel.close()
    cap = limits.max_output_bytes
    return bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap]), why


def _classify(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    return "signal" if returncode < 0 else "exit_nonzero"


def _run(code: str, stdin: str, limits: SandboxLimits, caps: Capabilities, python: str) -> SandboxResult:
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="jaxrl_sbx_")
    uid = _UID_BASE + 256 * os.getpid() + next(_run_counter) % 256 if caps.uid else None
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        os.chmod(workdir, 0o700)
        prelude = "" if caps.netns else _SOCKET_GUARD
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(prelude + code)
        env = {
            "PATH": _PATH,
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
        }
        # stdin comes from an unlinked file, not a pipe: a program that never reads cannot block us.
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            argv = [python, "-I", "main.py"]
            try:
                proc = _spawn(argv, workdir, env, limits, uid, caps.netns, caps.mountns, stdin_file)
            except (OSError, subprocess.SubprocessError) as e:
                return SandboxResult("launch_error", None, "", repr(e), time.monotonic() - start)
        try:
            out, err, why = _communicate(proc, limits)
        finally:
            _kill_group(proc.pid)
            proc.wait()  # before the sweep, which reaps by pid and would steal the main return code
            if uid is not None:
                _kill_uids(uid, uid + 1)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        # The CPU limit and the wall clock can fire together on a busy loop: report the CPU limit.
        status = _classify(proc.returncode, stderr) if proc.returncode == -signal.SIGXCPU else why
        status = status or _classify(proc.returncode, stderr)
        return SandboxResult(status, proc.returncode, stdout, stderr, time.monotonic() - start)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _interpreter_ok(python: str, caps: Capabilities) -> bool:
    probe = SandboxLimits(timeout_s=20.0, cpu_s=20)
    return _run("print('ok')", "", probe, caps, python).stdout.strip() == "ok"


@functools.cache
def capabilities() -> Capabilities:
    """Probes which isolation layers work here, once per process, by launching tiny sandboxed programs."""
    notes = []
    root = os.geteuid() == 0
    base = Capabilities(uid=False, netns=False, mountns=False)
    if not root:
        notes.append(
            "not root: no uid drop, so RLIMIT_NPROC and parent protection rely on the kernel defaults"
        )
        caps = base
    else:
        caps = Capabilities(uid=True, netns=False, mountns=False)
    for layer in ("netns", "mountns"):
        trial = dataclasses.replace(caps, **{layer: True})
        if _interpreter_ok(sys.executable, dataclasses.replace(trial, uid=False)):
            caps = trial
        else:
            notes.append(f"{layer} unavailable (unshare refused)")
    return dataclasses.replace(caps, notes=tuple(notes))


@functools.cache
def _pick_python(caps: Capabilities, preferred: str | None) -> str:
    candidates = [preferred] if preferred else [sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]
    for py in candidates:
        if py and os.path.exists(py) and _interpreter_ok(py, caps):
            return py
    raise RuntimeError(f"sandbox: no Python interpreter runnable by the sandboxed uid among {candidates}")


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as a Python program in the sandbox and returns its status and (capped) output.

    Args:
      code: the program text, written to `main.py` in a fresh temp dir that is removed afterwards.
      stdin: text fed to the program's standard input.
      limits: resource limits and the isolation policy.

    Returns:
      A SandboxResult; never raises for anything the program does.
    """
    # One run at a time per process: the run's uid is derived from our pid, and preexec_fn is not
    # thread-safe.
    with _RUN_LOCK:
        _become_subreaper()
        caps = capabilities()
        if limits.isolation == "strict" and not (caps.uid and caps.netns and caps.mountns):
            raise RuntimeError(f"sandbox: strict isolation requested but {caps.describe()}")
        return _run(code, stdin, limits, caps, _pick_python(caps, limits.python))


def _uid_and_state(pid: str) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["Uid"].split()[0]), fields["State"].split()[0]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _kill_uids(lo: int, hi: int) -> int:
    """SIGKILLs every process whose uid is in [lo, hi) (including ones that left the process group) and
    reaps those that were orphaned to us; rescans until none is alive, as a fork bomb may grow meanwhile."""
    seen: set[int] = set()
    for _ in range(20):
        alive = 0
        for entry in os.listdir("/proc"):
            info = _uid_and_state(entry) if entry.isdigit() else None
            if info is None or not lo <= info[0] < hi:
                continue
            seen.add(int(entry))
            if info[1] != "Z":
                alive += 1
                try:
                    os.kill(int(entry), signal.SIGKILL)
                except OSError:
                    pass
        if not alive:
            break
    for pid in seen:
        try:
            os.waitpid(pid, 0)  # ours only when we are their subreaper; others raise
        except ChildProcessError:
            pass
    return len(seen)


@functools.cache
def _become_subreaper() -> bool:
    """Orphans of sandboxed programs reparent to this process (not to an init that may never reap them)."""
    pr_set_child_subreaper = 36
    return _libc().prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def kill_leftovers(launcher_pid: int) -> int:
    """SIGKILLs processes left by sandboxed runs launched from `launcher_pid` (e.g. a reward worker that
    was itself killed mid-run); returns how many were signalled. Needs root, like the uid layer."""
    lo = _UID_BASE + 256 * launcher_pid
    return _kill_uids(lo, lo + 256)
