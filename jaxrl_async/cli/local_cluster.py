"""Runs a multi-process job on this machine: N controllers of the main job (`jaxrl-run`) on localhost (CPU).

  jaxrl-local-cluster --num-processes 2 --pin-cores -- \\
      --config=configs/tiny_arith.py --config.workdir=runs/tiny2 \\
      --config.mesh.sampler_processes='(0,)' --config.mesh.trainer_processes='(1,)'

(or `python launch/local_cluster.py ...`). The flags after `--` go to every process's `jaxrl-run`. Every
process also gets --coordinator_address (a free localhost port), --num_processes and --process_id, and
`--devices-per-process` fake CPU devices. `--pin-cores` gives each process its own block of cores
(os.sched_setaffinity), so the roles run in parallel as they would on separate hosts. `--cpu-sets` names
each process's cores instead, and they may overlap: `--cpu-sets=0,1:1` runs process 0 on both cores and
process 1 on core 1: a learner in process 0 then also uses the time the sampler leaves core 1 idle
(docs/benchmarks.md, "Time to accuracy"). Output lines are
prefixed with the process id (and kept in --log-dir when given). Every process gets the run's secret,
which signs the messages between them, in its environment (JAXRL_SECRET: a fresh one per launch unless
JAXRL_SECRET or JAXRL_SECRET_FILE is set already); it is on no command line and in no log. When a process
fails, the launcher says which, gives the others `--grace-s` seconds to stop on their own, then ends
them; its exit status is the first failure's (0 when every process succeeded).

  jaxrl-local-cluster --rehearse configs/math_8b.py

rehearses a config's process/role/mesh layout in miniature and checks the run (jaxrl_async/cli/rehearsal.py;
flags after `--` apply on top of the rehearsal's config). With `--rehearse-storage=bucket` (the default)
it also rehearses a pod's storage: a GCS emulator on localhost holds the model, the data and the workdir,
and each process runs in a root of its own (cwd, HOME, TMPDIR under --rehearse-workdir; nothing else is
shared). `--rehearse-kill-step=K` kills the learner lead (a trainer process) with SIGKILL once step K's
checkpoint is in the bucket, then starts the job again on fresh roots: it must resume from the bucket and
train every prompt once.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from jaxrl_async import storage
from jaxrl_async.cli import module_command, run_command
from jaxrl_async.runtime import secret

_NUM = flags.DEFINE_integer("num-processes", None, "Processes to start (not with --rehearse).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices-per-process", 1, "Fake CPU devices in each process.", lower_bound=1)
_PIN = flags.DEFINE_bool("pin-cores", False, "Give each process its own block of cores.")
_CPU_SETS = flags.DEFINE_string(
    "cpu-sets", "", "Each process's cores, ':' between processes: 0,1:1 or 0-3:4-7 (not with --pin-cores)."
)
_PORT = flags.DEFINE_integer("port", 0, "Coordinator port (0: a free one).")
_LOG_DIR = flags.DEFINE_string("log-dir", "", "Also write process_<i>.log files here.")
_GRACE = flags.DEFINE_float("grace-s", 45.0, "After a failure, wait this long for the rest.")
_HEARTBEAT = flags.DEFINE_integer("heartbeat-timeout-s", 10, "Each process's --heartbeat_timeout_s.")
_PYTHON = flags.DEFINE_string("python", sys.executable, "The interpreter that runs each process.")
_REHEARSE = flags.DEFINE_string(
    "rehearse", "", "CONFIG[:arg]: run its process/role/mesh layout in miniature and check the run."
)
_R_STEPS = flags.DEFINE_integer("rehearse-steps", 3, "Train steps of the rehearsal.", lower_bound=1)
_R_REPLICAS = flags.DEFINE_integer("rehearse-replicas", 1, "Sampler replicas kept.", lower_bound=1)
_R_TRAINERS = flags.DEFINE_integer("rehearse-trainer-processes", 1, "Trainer processes kept.", lower_bound=1)
_R_WORKDIR = flags.DEFINE_string("rehearse-workdir", "runs/rehearsal",
                                  "The rehearsal's workdir (a bucket: its config, log, process roots).")
_R_STORAGE = flags.DEFINE_enum("rehearse-storage", "bucket", ["bucket", "local"],
                               "bucket: the pod's storage (a GCS emulator, no shared local disk); local: a "
                               "local workdir every process shares.")
_R_KILL = flags.DEFINE_integer("rehearse-kill-step", 0, "Kill the learner lead at this step and resume the "
                               "job (0: no kill; needs --rehearse-storage=bucket).", lower_bound=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_blocks(num_processes: int, cores: list[int]) -> list[list[int]]:
    """Contiguous blocks of the available cores, one per process (shared round-robin if too few)."""
    per = max(1, len(cores) // num_processes)
    return [[cores[(i * per + j) % len(cores)] for j in range(per)] for i in range(num_processes)]


def parse_cpu_sets(text: str, num_processes: int, allowed: list[int]) -> list[list[int]]:
    """`--cpu-sets`: one core list per process (cpuset syntax, "0,2" or "0-3"), ':' between processes.

    Raises:
      ValueError: a malformed list, the wrong number of lists, or a core this launcher may not use.
    """
    parts = text.split(":")
    if len(parts) != num_processes:
        raise ValueError(f"{len(parts)} core lists for {num_processes} processes")
    sets = []
    for i, part in enumerate(parts):
        cores: set[int] = set()
        for item in part.split(","):
            lo, dash, hi = item.strip().partition("-")
            try:
                first, last = int(lo), int(hi if dash else lo)
            except ValueError:
                raise ValueError(f"process {i}: {item!r} is not a core or a range like 0-3") from None
            if first > last:
                raise ValueError(f"process {i}: the range {item!r} is empty")
            cores.update(range(first, last + 1))
        outside = sorted(cores - set(allowed))
        if outside:
            raise ValueError(f"process {i}: cores {outside} are not among this launcher's {allowed}")
        sets.append(sorted(cores))
    return sets


def child_env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    xla = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{xla} --xla_force_host_platform_device_count={devices}".strip()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    if not secret.present(env):  # one per run, in the environment only (see jaxrl_async.runtime.secret)
        env[secret.ENV_SECRET] = secret.generate()
    return env


def _ready(ready) -> bool:
    try:
        return bool(ready())
    except OSError:  # the bucket did not answer: ask again at the next line (the output keeps flowing)
        return False


def _pump(i: int, proc, log_file, kill=None) -> None:
    """Copies process i's output, prefixed. `kill` = (text, ready, killed): from the first line that
    contains `text` on, each line asks `ready()`; when it says yes, the process is SIGKILLed and its id
    appended to `killed`."""
    seen = False
    for line in iter(proc.stdout.readline, ""):
        if kill is not None:
            seen = seen or kill[0] in line
            if seen and _ready(kill[1]):
                proc.kill()
                kill[2].append(i)
                sys.stdout.write(f"[launcher] process {i} killed (SIGKILL) at: {line}")
                kill = None
        sys.stdout.write(f"[p{i}] {line}")
        sys.stdout.flush()
        if log_file is not None:
            log_file.write(line)
            log_file.flush()


def describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _run_flags(argv: list[str]) -> list[str]:
    """The flags after `--` (absl leaves them, verbatim, as the positional arguments).

    Raises:
      app.UsageError: a positional argument before `--`.
    """
    after = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    stray = argv[1 : len(argv) - len(after)]
    if stray:
        raise app.UsageError(f"unexpected arguments {stray}: the main job's flags go after `--`")
    return argv[len(argv) - len(after) :]


def main(argv: list[str]) -> int:
    run_flags = _run_flags(argv)
    if _REHEARSE.value:
        return _rehearse(run_flags)
    if _NUM.value is None:
        raise app.UsageError("--num-processes: required (or --rehearse CONFIG)")
    if _CPU_SETS.value and _PIN.value:
        raise app.UsageError("--cpu-sets names every process's cores: drop --pin-cores")
    return _launch(_NUM.value, _DEVICES.value, run_flags)


def _rehearse(run_flags: list[str]) -> int:
    """Runs `--rehearse`'s config in miniature (extra run flags after `--` apply on top), then checks it."""
    from jaxrl_async.cli import rehearsal
    from jaxrl_async.run_config import ConfigError, MeshConfig

    if _R_KILL.value and _R_STORAGE.value != "bucket":
        raise app.UsageError("--rehearse-kill-step: resuming needs --rehearse-storage=bucket")
    if _R_KILL.value >= _R_STEPS.value:
        raise app.UsageError(f"--rehearse-kill-step={_R_KILL.value}: must be below --rehearse-steps")
    try:
        target = rehearsal.load_config(_REHEARSE.value)
        mesh = MeshConfig(**target.mesh.to_dict())
        mini = rehearsal.miniature(mesh, _R_TRAINERS.value, _R_REPLICAS.value)
    except ConfigError as e:
        raise app.UsageError(f"--rehearse={_REHEARSE.value}: {e}") from None
    print(f"[rehearsal] {_REHEARSE.value}: {mini.describe()}", flush=True)
    local = os.path.abspath(_R_WORKDIR.value)
    if _R_STORAGE.value == "local":
        path = rehearsal.write_config(_REHEARSE.value, local, mini, _R_STEPS.value)
        return _rehearsal_result(rehearsal, mini, target, local, _launch_rehearsal(mini, path, run_flags))
    from jaxrl_async.cli.local_bucket import LocalBucket

    os.makedirs(local, exist_ok=True)
    with LocalBucket("rehearsal", log_path=os.path.join(local, "bucket.log")) as bucket:
        inputs = rehearsal.stage_inputs(bucket.url)
        workdir = f"{bucket.url}/run"
        path = rehearsal.write_config(_REHEARSE.value, workdir, mini, _R_STEPS.value, local, inputs)
        print(f"[rehearsal] storage: {bucket.url} on {bucket.env['STORAGE_EMULATOR_HOST']} (model, data, "
              f"workdir); each process in a root of its own under {local}", flush=True)  # fmt: skip
        launches = 1
        if _R_KILL.value:
            # Killed once the step's checkpoint is in the bucket (orbax marks a finished step on GCS with
            # commit_success.txt), so that the second start has something to resume from.
            marker = storage.join(workdir, "checkpoints", str(_R_KILL.value), "commit_success.txt")
            killed: list[int] = []
            status = _launch_rehearsal(mini, path, run_flags, os.path.join(local, "roots_1"),
                                       (f"step {_R_KILL.value} |", lambda: storage.exists(marker), killed))
            if not killed:
                print(f"[rehearsal] FAILED: the learner lead was not killed (no checkpoint of step "
                      f"{_R_KILL.value} in the bucket before the run ended, status {status})", flush=True)
                return 1
            print(f"[rehearsal] the learner lead was killed after step {_R_KILL.value}'s checkpoint (the job "
                  f"ended with status {status}); starting it again on fresh roots", flush=True)  # fmt: skip
            launches = 2
        status = _launch_rehearsal(mini, path, run_flags, os.path.join(local, f"roots_{launches}"))
        return _rehearsal_result(rehearsal, mini, target, workdir, status, launches)


def _launch_rehearsal(mini, path: str, run_flags: list[str], roots: str | None = None, kill=None) -> int:
    """One start of the rehearsal's job; `roots`: a folder under which each process gets its own root;
    `kill`: (text, ready, killed) for the learner lead (process 0), see `_pump`."""
    dirs = None
    if roots is not None:
        dirs = [os.path.join(roots, f"process_{i}") for i in range(mini.num_processes)]
        for d in dirs:
            os.makedirs(os.path.join(d, "tmp"), exist_ok=True)
    flags_ = [f"--config={path}", *run_flags]
    return _launch(mini.num_processes, mini.devices_per_process, flags_, dirs, {0: kill} if kill else {})


def _rehearsal_result(rehearsal, mini, target, workdir: str, status: int, launches: int = 1) -> int:
    if status != 0:
        print(f"[rehearsal] FAILED: the run ended with status {status}", flush=True)
        return status
    lines = rehearsal.verify(workdir, mini, target.max_staleness, target.mode, launches)
    for line in lines:
        print(f"[rehearsal] {line}", flush=True)
    failed = [line for line in lines if line.startswith("FAILED")]
    print(f"[rehearsal] {'FAILED' if failed else 'passed'}: {_REHEARSE.value}", flush=True)
    return 1 if failed else 0


def _root_env(env: dict[str, str], root: str) -> dict[str, str]:
    """`env` for a process whose host shares no disk with the others: its own HOME and TMPDIR (caches,
    a bucket model's local copy), and no compilation cache folder shared through the environment."""
    env = dict(env, HOME=root, TMPDIR=os.path.join(root, "tmp"), XDG_CACHE_HOME=os.path.join(root, ".cache"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAXRL_ASYNC_CACHE", None)
    return env


def _launch(n: int, devices: int, run_flags: list[str], roots: list[str] | None = None,
            kills: dict | None = None) -> int:  # fmt: skip
    """Starts and supervises the `n` processes. `roots`: each process's own cwd/HOME/TMPDIR. `kills`:
    process -> (text, ready, killed): the rehearsal's failure (`_pump`)."""
    port = _PORT.value or free_port()
    cores = sorted(os.sched_getaffinity(0))
    if _CPU_SETS.value:
        try:
            blocks = parse_cpu_sets(_CPU_SETS.value, n, cores)
        except ValueError as e:
            raise app.UsageError(f"--cpu-sets={_CPU_SETS.value}: {e}") from None
    else:
        blocks = core_blocks(n, cores) if _PIN.value else [None] * n
    if _LOG_DIR.value:
        os.makedirs(_LOG_DIR.value, exist_ok=True)
    env = child_env(devices)
    procs, pumps, logs = [], [], []
    for i in range(n):
        cmd = module_command("run", *run_flags, f"--coordinator_address=127.0.0.1:{port}",
                             f"--num_processes={n}", f"--process_id={i}",
                             f"--config.mesh.fake_cpu_devices={devices}",
                             f"--heartbeat_timeout_s={_HEARTBEAT.value}", python=_PYTHON.value)  # fmt: skip
        block = blocks[i]
        pre = (lambda block=block: os.sched_setaffinity(0, block)) if block else None
        log_file = open(os.path.join(_LOG_DIR.value, f"process_{i}.log"), "w") if _LOG_DIR.value else None
        logs.append(log_file)
        proc = subprocess.Popen(
            cmd, env=_root_env(env, roots[i]) if roots else env, cwd=roots[i] if roots else None,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pre,
        )  # fmt: skip
        procs.append(proc)
        t = threading.Thread(target=_pump, args=(i, proc, log_file, (kills or {}).get(i)), daemon=True)
        t.start()
        pumps.append(t)
        where = f" on cores {block}" if block else ""
        print(f"[launcher] process {i}{where}: pid {proc.pid}", flush=True)

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    status = _supervise(procs, _GRACE.value)
    for t in pumps:
        t.join(timeout=5)
    for f in logs:
        if f is not None:
            f.close()
    return status


def _supervise(procs: list, grace_s: float) -> int:
    """Waits for every process; after the first failure, stops the rest within `grace_s`."""
    first_failure, deadline = None, None
    while True:
        codes = [proc.poll() for proc in procs]
        if first_failure is None:
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    first_failure = (i, code)
                    deadline = time.monotonic() + grace_s
                    print(f"[launcher] process {i} {describe(code)}; the others stop too", flush=True)
                    break
        if all(c is not None for c in codes):
            break
        if deadline is not None and time.monotonic() > deadline:
            for i, proc in enumerate(procs):
                if proc.poll() is None:
                    print(f"[launcher] process {i} still runs after {grace_s:.0f} s: killing it", flush=True)
                    proc.kill()
            deadline = None
        time.sleep(0.2)
    if first_failure is None:
        print("[launcher] every process finished", flush=True)
        return 0
    for j, proc in enumerate(procs):
        print(f"[launcher] process {j} {describe(proc.returncode)}", flush=True)
    i, code = first_failure
    print(f"[launcher] run failed: process {i} {describe(code)}", flush=True)
    return code if code > 0 else 128 - code


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
