"""Faults and intruders injected into real multi-process runs on this machine: each scenario starts a
small 2-process run with `jaxrl-local-cluster` (learner lead = process 0, sampler = process 1), injects
its fault, and checks what the run did.

  python tools/chaos.py --scenario hostile     # a stranger sends hostile frames to the hub mid-run
  python tools/chaos.py --scenario hang        # SIGSTOP of the sampler process mid-run
  python tools/chaos.py --scenario reward      # SIGKILL of a reward worker while it grades
  python tools/chaos.py --scenario disk        # a checkpoint write fails (as on a full disk)
  python tools/chaos.py --scenario all --repeats 2 --out chaos.json   # the long form

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
saves version 1, then saves version 2 with every file write limited to 4 KiB (RLIMIT_FSIZE: EFBIG, as on
a full disk). Passes if that save raises, the next start restores version 1 (its values), and saves
version 2 again.

Random kills with resume are in tests/test_resume.py. Prints one line per scenario and run; exits 1 if
any failed.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time

from absl import flags

from jaxrl_async.cli import module_command, run_command

_SCENARIO = flags.DEFINE_enum(
    "scenario", "all", ["hostile", "hang", "reward", "disk", "all"], "The fault to inject."
)
_REPEATS = flags.DEFINE_integer("repeats", 1, "Runs of each scenario.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 4, "Train steps of the hostile scenario's run.", lower_bound=2)
_HEARTBEAT = flags.DEFINE_integer("heartbeat-timeout-s", 10, "The processes' --heartbeat_timeout_s.", 1)
_WORKDIR = flags.DEFINE_string("workdir", "", "Where the runs write (default: a temporary directory).")
_TIMEOUT = flags.DEFINE_float("timeout-s", 600.0, "Longest wait for one run.", lower_bound=1.0)
_OUT = flags.DEFINE_string("out", "", "Also write the results as JSON here.")

# A tiny run (the tests' small config): a random model, a reward that every group can earn.
CONFIG = """
from configs import tiny_arith


def get_config():
    c = tiny_arith.get_config()
    c.total_steps, c.prompts_per_step, c.samples_per_prompt = {steps}, 4, 4
    c.eval_every, c.eval_prompts, c.max_staleness = 0, 8, 1
    c.sampler.num_slots = 8
    c.trainer.token_budget, c.trainer.rows_per_micro = 64, 2
    c.warm_start.enabled = False
    c.reward.reward = "{reward}"
    c.reward.defaults = {{"format_regex": "[0-9]"}}
    c.checkpoint_every = 0
    return c
"""


class _Run:
    """A 2-process run under jaxrl-local-cluster, its output read line by line in a thread."""

    def __init__(self, workdir: str, steps: int, heartbeat_s: int, secret: str, reward: str = "format"):
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        path = os.path.join(workdir, "config.py")
        with open(path, "w") as f:
            f.write(CONFIG.format(steps=steps, reward=reward))
        cmd = module_command(
            "local_cluster", "--num-processes=2", f"--heartbeat-timeout-s={heartbeat_s}", "--grace-s=5", "--",
            f"--config={path}", f"--config.workdir={workdir}", "--config.mesh.trainer_processes=(0,)",
            "--config.mesh.sampler_processes=(1,)",
        )  # fmt: skip
        env = dict(os.environ, JAXRL_SECRET=secret)  # this tool plays a stranger who knows the run's secret
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [env.get("PYTHONPATH"), workdir])
        )  # chaos_slow_reward
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def expect(self, pattern: str, timeout_s: float) -> re.Match:
        """Waits for an output line matching `pattern`."""
        deadline = time.monotonic() + timeout_s
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m
        raise TimeoutError(f"no line matching {pattern!r}; last lines:\n{''.join(self.lines[-20:])}")

    def finish(self, timeout_s: float) -> int:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while (line := self._q.get()) is not None:
            self.lines.append(line)
        with open(os.path.join(self.workdir, "launcher.log"), "w") as f:
            f.writelines(self.lines)
        return self.proc.returncode

    def pid_of(self, process: int) -> int:
        return int(self.expect(rf"\[launcher\] process {process}.*: pid (\d+)", 60).group(1))


def _ledger(workdir: str, steps: int) -> dict:
    """What trained_uids.jsonl says: every version 1..steps present once, no prompt trained twice."""
    rows = []
    path = os.path.join(workdir, "trained_uids.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    uids = [u for r in rows for u in r["uids"]]
    versions = sorted(r["version"] for r in rows)
    return {"versions_complete": versions == list(range(1, steps + 1)), "prompts_trained": len(uids),
            "prompts_trained_twice": len(uids) - len(set(uids))}  # fmt: skip


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
# 4 KiB (RLIMIT_FSIZE: a write past it fails with EFBIG, as on a full disk) while version 2 is saved;
# "restore" is the next start of the run: it must find version 1, then save version 2 again.
CHECKPOINT_CHILD = """
import os, resource, signal, sys
import jax, jax.numpy as jnp
from flax import struct
from jaxrl_async.runtime.checkpoint import RunCheckpoints


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
    try:
        ckpts.save(2, state(2), {"version": 2}, wait=True)
        print("RESULT save2=ok")
    except Exception as e:
        print("RESULT save2=failed", type(e).__name__, str(e)[:160].replace(chr(10), " "))
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
        out["save_exit_status"] == 0 and out["restore_exit_status"] == 0 and bool(save)
        and save[0].startswith("save2=failed") and restore[:1] == ["restored 1 0.0 {'version': 1}"]
        and restore[1:] == ["steps [1, 2]"]
    )  # fmt: skip
    return {"scenario": "disk", "ok": ok, **out}


def _secret() -> str:
    from jaxrl_async.runtime import secret

    return secret.generate()


def main(argv) -> int:
    del argv
    scenarios = ["hostile", "hang", "reward", "disk"] if _SCENARIO.value == "all" else [_SCENARIO.value]
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
