"""Faults and intruders injected into real runs on this machine: each scenario starts a small run with
`jaxrl-local-cluster` (2 processes: learner lead = process 0, sampler = process 1; 3 processes: learner
lead 0, trainer follower 1, sampler 2) or `jaxrl-run`, injects its fault, and checks what the run did.

  python -m benchmarks.chaos --scenario hostile     # a stranger sends hostile frames to the hub mid-run
  python -m benchmarks.chaos --scenario hang        # SIGSTOP of the sampler process mid-run
  python -m benchmarks.chaos --scenario reward      # SIGKILL of a reward worker while it grades
  python -m benchmarks.chaos --scenario disk        # checkpoint writes fail (as on a full disk)
  python -m benchmarks.chaos --scenario kills --seed 0     # 5 SIGKILLs of random processes, 5 restarts
  python -m benchmarks.chaos --scenario hang-follower      # SIGSTOP of a trainer follower mid-run
  python -m benchmarks.chaos --scenario disk-run    # checkpoint writes of a running run fail
  python -m benchmarks.chaos --scenario all --repeats 2 --out chaos.json   # the long form

hostile: as soon as the hub is up, pickles that would create a file if unpickled, random bytes, a frame
from another run (same secret), one signed with another secret, one with a wrong MAC, and authentic
frames in process 1's name (one with the counter of its first frame, one with a fresh counter) on a
stranger's connection. Passes if nothing was unpickled, the run finishes (exit 0), and its
`perf/rejected_messages` counts every frame sent. (Replays on the sender's own connection and oversized
frames are driven against a hub in tests/test_wire_security.py.)

hang: the sampler process is stopped (SIGSTOP: alive, connections open, silent). Passes if the learner
lead ends within --heartbeat-timeout-s + 30 s with a message that names process 1.

reward: the run grades with a slow reward (0.3 s a completion); a reward worker of the sampler process
is killed while it grades. Passes if the run trains every step (exit 0) and the summary's reward stats
count the killed worker's completion as scored 0 (`worker_died`).

disk: the run's checkpoint manager (runtime/checkpoint.py, in a process of its own, not a whole run)
saves version 1, then versions 2 and 3 in the background and 4 waiting for its write, every file write
limited to 4 KiB (RLIMIT_FSIZE: EFBIG, as on a full disk). Passes if the background failures are warnings
(counted), version 4's save raises `CheckpointError` naming version 1 as the last good checkpoint, no
partial directory is left, and the next start restores version 1 (its values) and saves version 2 again.

kills: a 3-process run (--restart-steps steps, one epoch of data, a checkpoint every step, --kill-mode
sync by default) is SIGKILLed --kills times, each time in a random process after a random train step
(after the point it resumed from) plus a random fraction of a second, and started again with the same
command; then it runs to the end. --seed fixes the victims and times (--seed N --repeats 1 replays run
N of a longer invocation). Passes if every kill landed, the last start ends with exit 0, trained_uids.jsonl
(a version's last line counting) holds every version 1..steps and every prompt of the epoch exactly once,
and, in sync mode, the final parameters are bit-identical to an uninterrupted run of the same command.

hang-follower: the trainer follower (process 1 of 3) is stopped (SIGSTOP) after the first step. Passes if
the learner lead and the sampler each end within --heartbeat-timeout-s + 30 s, each with a message that
names process 1.

disk-run: a one-process run (one epoch, a checkpoint every step) is started; once version 2 is saved, every
file its process writes is limited to 1 MiB (RLIMIT_FSIZE set from outside with prlimit: the checkpoint's
data files are larger, the logs are not); after two failed saves the limit is lifted, and set again once a
save has succeeded (the run paused with SIGSTOP meanwhile, so that it cannot finish while the tool acts).
Passes if the failed saves are warnings and the run trains on, the last good checkpoint stays readable
meanwhile, a save succeeds once the limit is lifted, the final save (it waits for its write) fails and the
run stops with a message naming the last good checkpoint (exit 1), no partial checkpoint directory is
left, and the same command then resumes from that checkpoint and trains every prompt of the epoch
exactly once.

Prints one line per scenario and run; exits 1 if any failed.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import tempfile
import time

from absl import flags, logging

from benchmarks import chaos_runs
from benchmarks.chaos_runs import Run as _Run
from benchmarks.chaos_runs import disk_full_run, hung_follower, random_kills
from benchmarks.chaos_runs import ledger as _ledger
from jaxrl_async.cli import run_command

SCENARIOS = ["hostile", "hang", "reward", "disk", "kills", "hang-follower", "disk-run"]
_SCENARIO = flags.DEFINE_enum("scenario", "all", [*SCENARIOS, "all"], "The fault to inject.")
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each scenario.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 4, "Train steps of the hostile scenario's run.", lower_bound=2)
_HEARTBEAT = flags.DEFINE_integer("heartbeat-timeout-s", 10, "The processes' --heartbeat_timeout_s.", 1)
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the runs write (default: a temporary directory).")
_TIMEOUT = flags.DEFINE_float("timeout-s", 600.0, "Longest wait for one run.", lower_bound=1.0)
_OUT = flags.DEFINE_string("out", "", "Also write the results as JSON here.")
_COMPILE_CACHE = flags.DEFINE_string(
    "compile-cache-dir", "", "Every run's config.compile_cache_dir: a run loads what earlier ones compiled."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the kills scenario's victims and times (replay a failure).")
_KILLS = flags.DEFINE_integer("kills", 5, "SIGKILLs of the kills scenario (each followed by a restart).", 1)
_RESTART_STEPS = flags.DEFINE_integer(
    "restart-steps", 16, "Train steps (one epoch) of the kills and disk-run scenarios' runs.", lower_bound=8
)
_KILL_MODE = flags.DEFINE_enum(
    "kill-mode", "sync", ["sync", "async"], "The kills scenario's --config.mode (sync: bit identity too)."
)


class _Touch:
    """Unpickling this opens (creates) a file: what an attacker's pickle would do, harmlessly."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def hostile_frames(hub: str, run_id: str, secret: bytes, marker: str) -> dict[str, list]:
    """Frames a stranger sends to the hub at `hub` (HOST:PORT) of run `run_id`, by what they are."""
    from jaxrl_async.runtime.messages import TicketRequest
    from jaxrl_async.runtime.transport import ZmqTransport

    evil = pickle.dumps(("learner", _Touch(marker)))
    here = f"{hub}#{run_id}"
    forgers = {
        "other run": ZmqTransport(["x"], False, f"{hub}#{'ab' * 16}", 1, secret),
        "other secret": ZmqTransport(["x"], False, here, 1, os.urandom(32).hex().encode()),
        "this run": ZmqTransport(["x"], False, here, 1, secret),
    }
    first = forgers["this run"].seal("learner", TicketRequest(0, 1))  # counter 1: process 1's Hello's
    forgers["this run"]._sent = 10**9  # from now on fresh counters, far above the real process 1's
    wrong_mac = forgers["this run"].seal("learner", TicketRequest(0, 2))
    wrong_mac[3] = bytes(32)
    frames = {
        "pickle": [evil],
        "pickle as the last of 4 frames": [b"", b"", b"", evil],
        "random bytes": [os.urandom(256)],
        "random 4 frames": [os.urandom(33), os.urandom(100), b"", os.urandom(32)],
        "frame from another run": forgers["other run"].seal("learner", TicketRequest(0, 3)),
        "signed with another secret": forgers["other secret"].seal("learner", TicketRequest(0, 4)),
        "wrong MAC": wrong_mac,
        "authentic, process 1's first counter": first,
        "authentic, fresh counter": forgers["this run"].seal("learner", TicketRequest(0, 5)),
    }
    for t in forgers.values():
        t.close()
    return frames


def hostile(workdir: str, steps: int, heartbeat_s: int, timeout_s: float) -> dict:
    import zmq

    from jaxrl_async.runtime import secret
    from jaxrl_async.runtime.metrics import read_scalars

    key = secret.generate()
    marker = os.path.join(workdir, "unpickled")
    run = _Run(workdir, steps, heartbeat_s, key)
    sock = None
    try:
        m = run.expect(r"message hub on (\S+) \(run id ([0-9a-f]+)\)", timeout_s)  # before step 1
        frames = hostile_frames(m.group(1), m.group(2), key.encode(), marker)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{m.group(1)}")
        for parts in frames.values():
            sock.send_multipart(parts)
    finally:
        code = run.finish(timeout_s)  # the stranger stays connected until the run ends
        if sock is not None:
            sock.close()
    scalars = read_scalars(os.path.join(workdir, "tb")).get("perf/rejected_messages", [])
    rejected = max((v for _, v in scalars), default=0.0)
    ledger = _ledger(workdir, steps)
    ok = code == 0 and not os.path.exists(marker) and rejected >= len(frames) and ledger["versions_complete"]
    ok = ok and ledger["prompts_trained_twice"] == 0
    return {"scenario": "hostile", "ok": ok, "exit_status": code, "frames_sent": len(frames), **ledger,
            "rejected_counted": rejected, "unpickled": os.path.exists(marker), "kinds": list(frames),
            **({} if ok else {"log_tail": "".join(run.lines[-30:])})}  # fmt: skip


def hang(workdir: str, heartbeat_s: int, timeout_s: float) -> dict:
    """SIGSTOP of the sampler after step 1; the learner lead must end within heartbeat + 30 s."""
    run = _Run(workdir, 1000, heartbeat_s, _secret())
    try:
        sampler = run.pid_of(1)
        run.expect(r"step \d+ \|", timeout_s)
        os.kill(sampler, signal.SIGSTOP)
        stopped = time.monotonic()
        lead_end = run.expect(r"\[launcher\] process 0 (exited|was killed)", heartbeat_s + 90)
        ended_s = time.monotonic() - stopped
    except TimeoutError:
        lead_end, ended_s = None, None
    finally:
        try:
            os.kill(sampler, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
        code = run.finish(timeout_s)
    text = "".join(run.lines)
    # JAX's heartbeat names the silent task on the next line: "... (stopped sending heartbeats):\n1"
    named = bool(re.search(r"stopped sending heartbeats\):\s*(\[p\d+\] )?1\s|process 1 \(", text))
    ok = lead_end is not None and ended_s <= heartbeat_s + 30 and named and code != 0
    return {"scenario": "hang", "ok": ok, "exit_status": code, "lead_ended_after_s": ended_s,
            "limit_s": heartbeat_s + 30, "names_process_1": named,
            **({} if ok else {"log_tail": "".join(run.lines[-30:])})}  # fmt: skip


# A reward that takes a while and marks the worker busy meanwhile (a file named after its pid), so that
# the worker can be killed in the middle of grading.
SLOW_REWARD = """
import os, re, time


def slow_format(prompt, completion, metadata):
    busy = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"busy.{os.getpid()}")
    open(busy, "w").close()
    time.sleep(0.3)
    os.remove(busy)
    return 1.0 if re.search("[0-9]", completion) else 0.0
"""


def reward_worker(workdir: str, steps: int, heartbeat_s: int, timeout_s: float) -> dict:
    """SIGKILL of a reward worker of the sampler process while it grades; the run must train every step,
    its completion scored 0 and counted (`worker_died`), the worker replaced."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "chaos_slow_reward.py"), "w") as f:
        f.write(SLOW_REWARD)
    run = _Run(workdir, steps, heartbeat_s, _secret(), reward="chaos_slow_reward:slow_format")
    killed = None
    try:
        run.expect(r"step 1 \|", timeout_s)
        deadline = time.monotonic() + 60
        while killed is None and time.monotonic() < deadline:
            busy = [n for n in os.listdir(workdir) if n.startswith("busy.")]
            if busy:
                killed = int(busy[0].split(".")[1])
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.01)
    finally:
        code = run.finish(timeout_s)
    summary = {}
    if os.path.exists(os.path.join(workdir, "summary.json")):
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
    stats = summary.get("reward_stats") or {}
    died = stats.get("errors", {}).get("worker_died", 0)
    ledger = _ledger(workdir, steps)
    ok = code == 0 and killed is not None and summary.get("steps") == steps and died >= 1
    ok = ok and ledger["versions_complete"] and ledger["prompts_trained_twice"] == 0
    return {"scenario": "reward", "ok": ok, "exit_status": code, "killed_worker": killed, **ledger,
            "steps": summary.get("steps"), "scored_0_worker_died": died,
            "worker_restarts": stats.get("worker_restarts"),
            **({} if ok else {"log_tail": "".join(run.lines[-30:])})}  # fmt: skip


# The run's checkpoint manager in a process of its own: version 1 saved, then every file write limited to
# 4 KiB (RLIMIT_FSIZE: a write past it fails with EFBIG, as on a full disk) while versions 2-4 are saved;
# "restore" is the next start of the run: it must find version 1, then save version 2 again.
CHECKPOINT_CHILD = """
import os, resource, signal, sys
import jax, jax.numpy as jnp
from flax import struct
from jaxrl_async.runtime.checkpoint import CheckpointError, RunCheckpoints


@struct.dataclass
class State:
    params: dict
    opt_state: dict
    version: jax.Array
    updates: jax.Array
    skipped: jax.Array


def state(v):
    w = jax.random.normal(jax.random.key(v), (256, 256)) + v  # random: no compression hides the size
    return State({"w": w}, {"m": w * 0}, jnp.int32(v), jnp.int32(v), jnp.int32(0))


directory, mode = sys.argv[1:3]
ckpts = RunCheckpoints(directory)
if mode == "save":
    ckpts.save(1, state(1), {"version": 1}, wait=True)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    ckpts.save(2, state(2), {"version": 2})  # written in the background: a failure shows at the next save
    ckpts.save(3, state(3), {"version": 3})  # warns about version 2, fails in the background too
    print("RESULT background failures", ckpts.failures)
    try:  # a save that waits for its write (the final one) raises
        ckpts.save(4, state(4), {"version": 4}, wait=True)
        print("RESULT save4=ok")
    except CheckpointError as e:
        print("RESULT save4=failed, names version 1:", "the last good checkpoint is version 1 in" in str(e))
    print("RESULT failures", ckpts.failures, "on disk", sorted(os.listdir(directory)))
else:
    got = ckpts.restore_latest(state(0))
    if got is None:
        print("RESULT restored nothing")
    else:  # the version, its weights' mean minus that version (about 0), the coordinator state
        print("RESULT restored", got[1], round(float(got[0].params["w"].mean()) - got[1], 1), got[2])
    ckpts.save(2, state(2), {"version": 2}, wait=True)
    ckpts.close()
    print("RESULT steps", RunCheckpoints(directory).manager.all_steps())
"""


def checkpoint_write_error(workdir: str, timeout_s: float) -> dict:
    """A checkpoint write that fails (RLIMIT_FSIZE) after a good one; the good one must stay the one a
    resume takes, and the resumed run must save the failed version again."""
    import sys

    directory = os.path.join(workdir, "checkpoints")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = {}
    for mode in ("save", "restore"):
        res = subprocess.run([sys.executable, "-c", CHECKPOINT_CHILD, directory, mode], env=env,
                             capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
        out[mode] = [line[7:] for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        out[f"{mode}_exit_status"] = res.returncode
    save, restore = out["save"], out["restore"]
    ok = (
        out["save_exit_status"] == 0 and out["restore_exit_status"] == 0
        and save == ["background failures 1", "save4=failed, names version 1: True",
                     "failures 3 on disk ['1']"]
        and restore == ["restored 1 0.0 {'version': 1}", "steps [1, 2]"]
    )  # fmt: skip
    return {"scenario": "disk", "ok": ok, **out}


def _secret() -> str:
    from jaxrl_async.runtime import secret

    return secret.generate()


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it reads (disk-run, kills)
    scenarios = SCENARIOS if _SCENARIO.value == "all" else [_SCENARIO.value]
    chaos_runs.COMPILE_CACHE_DIR = _COMPILE_CACHE.value
    hb, timeout = _HEARTBEAT.value, _TIMEOUT.value
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = _WORKDIR.value or tmp
        for i in range(_REPEATS.value):
            for name in scenarios:
                workdir = os.path.join(root, f"{name}_{i}")
                t0 = time.monotonic()
                if name == "hostile":
                    res = hostile(workdir, _STEPS.value, hb, timeout)
                elif name == "reward":
                    res = reward_worker(workdir, _STEPS.value, hb, timeout)
                elif name == "disk":
                    res = checkpoint_write_error(workdir, timeout)
                elif name == "kills":
                    seed, steps = _SEED.value + i, _RESTART_STEPS.value
                    mode = _KILL_MODE.value
                    res = random_kills(workdir, steps, _KILLS.value, seed, hb, timeout, _secret(), mode)
                elif name == "hang-follower":
                    res = hung_follower(workdir, hb, timeout, _secret())
                elif name == "disk-run":
                    res = disk_full_run(workdir, _RESTART_STEPS.value, timeout, _secret())
                else:
                    res = hang(workdir, hb, timeout)
                res["wall_s"] = round(time.monotonic() - t0, 1)
                results.append(res)
                shown = {k: v for k, v in res.items() if k != "log_tail"}
                print(f"[chaos] {'PASS' if res['ok'] else 'FAIL'} {json.dumps(shown)}", flush=True)
                if not res["ok"]:
                    print(res.get("log_tail", ""), flush=True)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=2)
    failed = sum(not r["ok"] for r in results)
    print(f"[chaos] {len(results) - failed} of {len(results)} passed", flush=True)
    return 1 if failed else 0


def run() -> None:
    run_command(main, __name__)


if __name__ == "__main__":
    run()
