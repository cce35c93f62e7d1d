"""Run untrusted Python programs in a contained subprocess (minimal root, rlimits, no network, timeouts).

Two entry points: `run_python` runs a program as the main program (stdin/stdout tests), `run_harness`
runs the grading harness (`harness.py`) as the main program, which loads the program as a module and
reports results with a per-run nonce on a pipe only it holds.

Layers, each used when the kernel and our privileges allow it (see `capabilities()`):
  * always: own temp working dir, scrubbed environment, `python -I`, new session, CPU / address-space /
    process / file-size / open-file rlimits, wall-clock timeout that SIGKILLs the whole process group,
    stdout/stderr capped (the program is killed when it exceeds the cap);
  * `uid`: the program runs under a fresh unprivileged uid (root only), so RLIMIT_NPROC bites, it cannot
    signal its parent, read the parent's `/proc/<pid>/environ` or write files it does not own, and every
    process it leaves behind (even ones that called setsid) is found by that uid in /proc and killed;
    the harness's judge runs under a second fresh uid, out of the program's reach;
  * `netns`: a private network namespace (no interfaces up, so every connect fails);
  * `fsview`: a private mount namespace whose root holds only the interpreter's files, a few devices,
    the working dir and a `/proc` that lists only the run uid's processes (`fsview.py`);
  * `mountns`: the fallback when `fsview` is unavailable: every host mount except the working dir is
    made read-only (the host tree stays visible).
Without `netns` a Python audit hook refuses socket connect/bind/sendto (a weaker guard: code that
reaches libc through ctypes gets past it).
"""

from __future__ import annotations

import atexit
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
from collections.abc import Mapping
from typing import Any

from jaxrl_async.rewards.sandbox import fsview, harness, wire

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
# Each run gets the uid pair U, U + 1 with U = BASE + 512 * launcher pid + 2 * (run counter % 256):
# unique among live launchers, fresh for each run (killed processes may linger as zombies and count
# against the next run's RLIMIT_NPROC), and far above any uid a real account uses (pids < 2**22, so
# uids stay below 2**32 - 1). The program runs as U; the harness's judge as U + 1. The base differs from
# the one of the earlier one-uid-per-run layout (1.5e9 + 256 * pid + k), so that launchers of both
# layouts running on one host do not share uids (and sweep each other's runs) for pids below 390k.
_UID_BASE = 1_600_000_000
_UIDS_PER_LAUNCHER = 512
_run_counter = itertools.count()
_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_ENV = {"PATH": _PATH, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}  # the whole environment inside
_MAX_REPORT_BYTES = 16 << 20
_RUN_LOCK = threading.Lock()
_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandboxed run.

    Attributes:
      timeout_s: wall-clock limit; the whole process group (and the run's uids) is SIGKILLed after it.
      cpu_s: RLIMIT_CPU in seconds (per process).
      memory_mb: RLIMIT_AS (address space) in MiB (per process).
      max_processes: RLIMIT_NPROC (processes and threads of the run's uid; only enforced off root).
      max_file_mb: RLIMIT_FSIZE in MiB (largest file the program may write).
      max_open_files: RLIMIT_NOFILE.
      max_output_bytes: cap on stdout and stderr each; exceeding it kills the program.
      isolation: "auto" uses every layer that works here; "strict" raises unless uid, netns and fsview
        all work (a layer that fails during a run then fails that run: status launch_error).
      python: interpreter for the program; None picks the first of /usr/bin/python3,
        /usr/local/bin/python3 and this process's base interpreter that runs in the sandbox.
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
class HarnessResult:
    """Outcome of one harness run: the sandbox's result (its status and exit code say nothing about the
    tests) and the records the judge reported with this run's nonce, e.g. ["pass"], ["case", 0, ...]."""

    run: SandboxResult
    records: tuple[list, ...]


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """Which isolation layers work in this process (probed once)."""

    uid: bool
    netns: bool
    fsview: bool
    mountns: bool
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        layers = [n for n in ("uid", "netns", "fsview", "mountns") if getattr(self, n)]
        net = "private network namespace" if self.netns else "audit-hook socket guard (bypassable)"
        return f"layers={layers or ['rlimits only']}; network: {net}; " + "; ".join(self.notes)

    @property
    def strict(self) -> bool:
        """All the layers `isolation="strict"` requires."""
        return self.uid and self.netns and self.fsview


@dataclasses.dataclass(frozen=True)
class _Launch:
    """What the forked child needs before exec."""

    workdir: str
    rootdir: str
    limits: SandboxLimits
    uid: int | None
    harness: bool
    netns: bool
    plan: fsview.RootPlan | None
    mountns: bool
    error_fd: int  # where the child writes why its set-up failed (Popen only says that it did)
    harness_dir: str | None  # host dir of the precompiled harness, bound at fsview.HARNESS_DIR


def _child_setup(launch: _Launch):
    """Runs in the forked child before exec: namespaces, the filesystem view, rlimits, then the uid drop
    (order matters: mounts need root). Any failure raises, so the run fails with launch_error."""
    try:
        _isolate(launch)
    except BaseException as e:
        os.write(launch.error_fd, repr(e).encode()[:500])
        raise


def _isolate(launch: _Launch):
    mountns = launch.plan is not None or launch.mountns
    lib = fsview.libc() if (launch.netns or mountns) else None
    if launch.netns or mountns:
        flags = (_CLONE_NEWNET if launch.netns else 0) | (_CLONE_NEWNS if mountns else 0)
        fsview.check(lib.unshare(flags), "unshare")
    if mountns:
        fsview.make_private(lib)
    if launch.plan is not None:
        fsview.enter(launch.plan, launch.rootdir, launch.workdir, launch.harness_dir)
    else:
        if launch.mountns:
            fsview.readonly_host(lib, launch.workdir)
        # The cwd set by Popen points at the directory under the now read-only root; re-enter the bind.
        os.chdir(launch.workdir)
    mb = 1 << 20
    limits = launch.limits
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
    if launch.uid is not None:
        os.setgroups([])
        # The harness starts with real uid U + 1 (the judge's) and effective uid U (the program's; exec
        # copies it to the saved uid): its program process then takes U for good and the judge U + 1.
        real = launch.uid + 1 if launch.harness else launch.uid
        os.setresgid(real, launch.uid, launch.uid)
        os.setresuid(real, launch.uid, launch.uid)


def _communicate(proc: subprocess.Popen, limits: SandboxLimits, report_fd: int | None):
    """Reads capped stdout/stderr (and the harness report) until exit or a limit; returns
    (out, err, report, why_killed)."""
    streams = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    caps = {fd: limits.max_output_bytes for fd in streams}
    if report_fd is not None:
        streams[report_fd], caps[report_fd] = bytearray(), _MAX_REPORT_BYTES
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.timeout_s
    why = None

    def read_ready(timeout: float) -> tuple[bool, bool]:
        """Reads what is ready; returns (any stream still open, anything was ready)."""
        events = sel.select(timeout=timeout)
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            buf = streams[key.fd]
            buf += chunk[: caps[key.fd] + 1 - len(buf)]
        return bool(sel.get_map()), bool(events)

    def over() -> bool:
        return any(len(b) > caps[fd] for fd, b in streams.items())

    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "timeout"
            break
        streams_open, _ = read_ready(min(left, 0.05))
        if over():
            why = "output_limit"
            break
        # The main process decides the outcome; a leftover child holding the pipes open is killed after.
        if not streams_open or proc.poll() is not None:
            while streams_open and not over():
                streams_open, ready = read_ready(0)
                if not ready:
                    break
            break
    sel.close()
    out, err = (bytes(streams[f.fileno()][: limits.max_output_bytes]) for f in (proc.stdout, proc.stderr))
    report = bytes(streams[report_fd][:_MAX_REPORT_BYTES]) if report_fd is not None else b""
    return out, err, report, why


def _classify(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "ok"
    if returncode == -signal.SIGXCPU:
        return "cpu_limit"
    if "MemoryError" in stderr:
        return "memory_limit"
    return "signal" if returncode < 0 else "exit_nonzero"


def run_raw(program: str, limits: SandboxLimits, caps: Capabilities, python: str, *, stdin: str = "",
         job: bytes | None = None) -> tuple[SandboxResult, bytes]:
    """One sandboxed run of `program` (as main.py) with exactly the layers `caps` names (benchmarks time
    each layer so): as the main program, or under the harness when a `job` is given. Returns the result
    and the harness report's raw bytes. `run_python` and `run_harness` are the graders' entry points."""
    start = time.monotonic()
    base = tempfile.mkdtemp(prefix="jaxrl_sbx_")
    workdir, rootdir = os.path.join(base, "work"), os.path.join(base, "root")
    uid = _UID_BASE + _UIDS_PER_LAUNCHER * os.getpid() + 2 * (next(_run_counter) % 256) if caps.uid else None
    report_r = report_w = None
    error_r, error_w = os.pipe()
    first_pid = _last_pid()
    try:
        os.chmod(base, 0o711)
        os.mkdir(workdir, 0o700)
        os.mkdir(rootdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        guard = not caps.netns
        with open(os.path.join(workdir, wire.PROGRAM), "w") as f:
            f.write((wire.SOCKET_GUARD if guard and job is None else "") + program)
        plan = fsview.plan_for(python, tuple(sorted(SANDBOX_ENV.items()))) if caps.fsview else None
        home = fsview.SANDBOX_DIR if plan else workdir
        env = {**SANDBOX_ENV, "HOME": home, "TMPDIR": home}
        exe = plan.python if plan else python
        harness_dir = _harness_dir(python) if job is not None else None
        launch = _Launch(workdir, rootdir, limits, uid, job is not None, caps.netns, plan, caps.mountns,
                         error_w, harness_dir)
        # stdin and the job come from unlinked files, not pipes: a program that never reads cannot
        # block us, and nobody can open them by name.
        with tempfile.TemporaryFile() as stdin_file, tempfile.TemporaryFile() as job_file:
            stdin_file.write(stdin.encode())
            stdin_file.seek(0)
            argv, pass_fds = [exe, "-I", wire.PROGRAM], ()
            if job is not None:
                job_file.write(job)
                job_file.seek(0)
                report_r, report_w = os.pipe()
                fds = (job_file.fileno(), report_w)
                where = fsview.HARNESS_DIR if plan else harness_dir
                main = (f"import sys; sys.path.insert(0, {where!r}); "
                        "from jaxrl_async.rewards.sandbox import harness; harness.main(sys.argv)")
                argv = [exe, "-I", "-c", main, *map(str, fds), "1" if guard else "0"]
                pass_fds = fds
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    env=env,
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=pass_fds,
                    preexec_fn=functools.partial(_child_setup, launch),
                )
            except (OSError, subprocess.SubprocessError) as e:
                os.close(error_w)
                error_w = None
                why = os.read(error_r, 1000).decode(errors="replace") or repr(e)
                return SandboxResult("launch_error", None, "", why, time.monotonic() - start), b""
            finally:
                if report_w is not None:
                    os.close(report_w)
        try:
            out, err, report, why = _communicate(proc, limits, report_r)
        finally:
            _kill_group(proc.pid)
            proc.wait()  # before the sweep, which reaps by pid and would steal the main return code
            if uid is not None:
                _kill_uids(uid, uid + 2, since=first_pid)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        # The CPU limit and the wall clock can fire together on a busy loop: report the CPU limit.
        status = _classify(proc.returncode, stderr) if proc.returncode == -signal.SIGXCPU else why
        status = status or _classify(proc.returncode, stderr)
        return SandboxResult(status, proc.returncode, stdout, stderr, time.monotonic() - start), report
    finally:
        for fd in (report_r, error_r, error_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(base, ignore_errors=True)


@functools.cache
def _harness_dir(python: str) -> str:
    """A world-readable copy of harness.py and wire.py (as `jaxrl_async.rewards.sandbox`, with empty
    package files: the sandbox imports the standard library only), compiled by `python` so that runs
    skip compiling them; removed when this process exits."""
    path = tempfile.mkdtemp(prefix="jaxrl_harness_")
    atexit.register(shutil.rmtree, path, True)
    package = os.path.join(path, "jaxrl_async", "rewards", "sandbox")
    os.makedirs(package)
    for depth in range(1, 4):  # jaxrl_async/, jaxrl_async/rewards/, jaxrl_async/rewards/sandbox/
        open(os.path.join(path, *("jaxrl_async", "rewards", "sandbox")[:depth], "__init__.py"), "w").close()
    for module in (harness, wire):
        shutil.copyfile(module.__file__, os.path.join(package, os.path.basename(module.__file__)))
    subprocess.run([python, "-I", "-m", "compileall", "-q", path], check=True, capture_output=True)
    for root, _, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    return path


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _interpreter_ok(python: str, caps: Capabilities) -> bool:
    probe = SandboxLimits(timeout_s=20.0, cpu_s=20)
    try:
        return run_raw("print('ok')", probe, caps, python)[0].stdout.strip() == "ok"
    except OSError:
        return False


def _default_pythons() -> list[str]:
    base = getattr(sys, "_base_executable", None) or sys.executable
    return [p for p in (*_PYTHONS, os.path.realpath(base)) if p and os.path.exists(p)]


@functools.cache
def capabilities() -> Capabilities:
    """Probes which isolation layers work here, once per process, by launching tiny sandboxed programs
    (with the first default interpreter that runs at all)."""
    notes = []
    root = os.geteuid() == 0
    caps = Capabilities(uid=root, netns=False, fsview=False, mountns=False)
    if not root:
        notes.append(
            "not root: no uid drop and no mount namespace, so RLIMIT_NPROC and parent protection rely on "
            "the kernel defaults and the host filesystem stays visible"
        )
    pythons = _default_pythons()
    python = next((p for p in pythons if _interpreter_ok(p, caps)), None)
    if python is None:
        return dataclasses.replace(caps, notes=(*notes, f"no interpreter runs in the sandbox: {pythons}"))
    for layer in ("netns", "fsview", "mountns"):
        if layer == "mountns" and caps.fsview:
            break  # the fallback is only needed without the minimal root
        trial = dataclasses.replace(caps, **{layer: True})
        if _interpreter_ok(python, trial):
            caps = trial
        else:
            notes.append(f"{layer} unavailable ({_layer_error(python, trial)})")
    return dataclasses.replace(caps, notes=tuple(notes))


def _layer_error(python: str, caps: Capabilities) -> str:
    """Why a probe run failed, in a few words (the launch error's message, else its stderr's tail)."""
    try:
        res = run_raw("print('ok')", SandboxLimits(timeout_s=20.0, cpu_s=20), caps, python)[0]
    except OSError as e:
        return str(e)
    return (res.stderr.strip().splitlines() or [res.status])[-1][:200]


@functools.cache
def pick_python(caps: Capabilities, preferred: str | None) -> str:
    """The interpreter the sandbox runs: `preferred`, or the first default one that runs under `caps`."""
    candidates = [preferred] if preferred else _default_pythons()
    for py in candidates:
        if py and os.path.exists(py) and _interpreter_ok(py, caps):
            return py
    raise RuntimeError(f"sandbox: no Python interpreter runs in the sandbox among {candidates}")


def _prepare(limits: SandboxLimits) -> tuple[Capabilities, str]:
    _become_subreaper()
    caps = capabilities()
    if limits.isolation == "strict" and not caps.strict:
        raise RuntimeError(f"sandbox: strict isolation needs uid, netns and fsview, but {caps.describe()}")
    return caps, pick_python(caps, limits.python)


def run_python(code: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs `code` as the main Python program in the sandbox and returns its status and (capped) output.

    Args:
      code: the program text, written to `main.py` in a fresh temp dir that is removed afterwards.
      stdin: text fed to the program's standard input.
      limits: resource limits and the isolation policy.

    Returns:
      A SandboxResult; never raises for anything the program does.

    Raises:
      RuntimeError: `isolation="strict"` and a required layer is unavailable.
    """
    # One run at a time per process: the run's uids are derived from our pid, and preexec_fn is not
    # thread-safe.
    with _RUN_LOCK:
        caps, python = _prepare(limits)
        return run_raw(code, limits, caps, python, stdin=stdin)[0]


def run_harness(
    program: str, job: Mapping[str, Any], limits: SandboxLimits = SandboxLimits()
) -> HarnessResult:
    """Runs the grading harness on `program` (see harness.py): it loads the program as module `solution`
    and runs `job` against it, reporting with a fresh nonce on a pipe only the harness's judge holds.

    Args:
      program: the candidate's source.
      job: {"mode": "test_code", "test_code": str} or {"mode": "calls", "entry_point": "f" or
        "Class.method", "calls": [[encoded args, encoded kwargs], ...]} (wire.encode).
      limits: resource limits and the isolation policy (timeout_s covers the whole run).

    Returns:
      The run's result and the report records that carry this run's nonce.
    """
    data, nonce = wire.make_job(dict(job))
    with _RUN_LOCK:
        caps, python = _prepare(limits)
        broken = _harness_error(caps, python)
        if broken:
            raise RuntimeError(f"sandbox: the grading harness does not work here ({broken})")
        result, report = run_raw(program, limits, caps, python, job=data)
    return HarnessResult(result, tuple(wire.read_report(report, nonce)))


@functools.cache
def _harness_error(caps: Capabilities, python: str) -> str | None:
    """None when the harness passes a trivial test here, else what went wrong (checked once)."""
    data, nonce = wire.make_job({"mode": "test_code", "test_code": "assert f() == 1"})
    res, report = run_raw("def f():\n    return 1\n", SandboxLimits(timeout_s=20.0, cpu_s=20), caps, python,
                       job=data)
    records = wire.read_report(report, nonce)
    if ["pass"] in records:
        return None
    return f"{res.status}; report {records}; stderr {res.stderr.strip()[-300:]!r}"


def _uid_and_state(pid: str) -> tuple[int, str] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["Uid"].split()[0]), fields["State"].split()[0]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def _last_pid() -> int | None:
    """The pid this pid namespace allocated last (None where the kernel does not say)."""
    try:
        with open("/proc/sys/kernel/ns_last_pid") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _kill_uids(lo: int, hi: int, since: int | None = None) -> int:
    """SIGKILLs every process whose uid is in [lo, hi) (including ones that left the process group) and
    reaps those that were orphaned to us; rescans until none is alive, as a fork bomb may grow meanwhile.

    `since`: the last pid allocated before those processes started. Only pids allocated after it are
    read then (a run's processes are all younger), unless the pid counter wrapped around meanwhile.
    """
    seen: set[int] = set()
    for _ in range(20):
        last = _last_pid() if since is not None else None
        pids = (int(e) for e in os.listdir("/proc") if e.isdigit())
        if last is not None and last >= since:
            pids = (p for p in pids if since < p <= last)
        alive = 0
        for pid in pids:
            info = _uid_and_state(str(pid))
            if info is None or not lo <= info[0] < hi:
                continue
            seen.add(pid)
            if info[1] != "Z":
                alive += 1
                try:
                    os.kill(pid, signal.SIGKILL)
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
    return fsview.libc().prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0


def kill_leftovers(launcher_pid: int) -> int:
    """SIGKILLs processes left by sandboxed runs launched from `launcher_pid` (e.g. a reward worker that
    was itself killed mid-run); returns how many were signalled. Needs root, like the uid layer."""
    lo = _UID_BASE + _UIDS_PER_LAUNCHER * launcher_pid
    return _kill_uids(lo, lo + _UIDS_PER_LAUNCHER)
