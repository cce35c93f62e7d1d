"""The runs benchmarks/chaos.py injects its faults into (no command: benchmarks/chaos.py is), and the
scenarios that restart them: random kills of a 3-process run, a hung trainer follower, a checkpoint write
that fails inside a running run. See chaos.py's docstring for what each one checks.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import resource
import signal
import subprocess
import threading
import time

from jaxrl_async.cli import module_command

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
    c.data.num_epochs = {epochs}
    return c
"""
PROMPTS = 4  # per step, as CONFIG says
# Every run's config.compile_cache_dir (chaos.py --compile-cache-dir; "" = none): runs after the first load
# their programs, the sampler processes' too (runtime/compile_cache.py), instead of compiling them again.
COMPILE_CACHE_DIR = ""

# Process layouts: (processes, sampler processes, trainer processes, trainer mesh); None: one process.
TWO = (2, "(1,)", "(0,)", "(1,1)")
THREE = (3, "(2,)", "(0,1)", "(2,1)")  # learner lead 0, trainer follower 1, sampler 2


def epoch_flags(steps: int) -> list[str]:
    """Exactly `steps` batches of data (one epoch of them with `epochs=1`), a checkpoint after every
    step: the ledger then names every prompt of the data set once."""
    return ["--config.checkpoint_every=1", f"--config.data.num_train={steps * PROMPTS}"]


class Run:
    """A run (a `jaxrl-local-cluster` of `layout`, or one `jaxrl-run` process), its output read line by
    line in a thread."""

    def __init__(self, workdir: str, steps: int, heartbeat_s: int, secret: str, reward: str = "format",
                 layout: tuple | None = TWO, extra=(), epochs: int | None = None):  # fmt: skip
        os.makedirs(workdir, exist_ok=True)
        self.workdir = workdir
        path = os.path.join(workdir, "config.py")
        with open(path, "w") as f:
            f.write(CONFIG.format(steps=steps, reward=reward, epochs=epochs))
        flags = [f"--config={path}", f"--config.workdir={workdir}", *extra]
        if COMPILE_CACHE_DIR:
            flags.append(f"--config.compile_cache_dir={COMPILE_CACHE_DIR}")
        if layout is None:
            cmd = module_command("run", *flags)
        else:
            n, samplers, trainers, mesh = layout
            cmd = module_command(
                "local_cluster", f"--num-processes={n}", f"--heartbeat-timeout-s={heartbeat_s}",
                "--grace-s=5", "--", *flags, f"--config.mesh.trainer_processes={trainers}",
                f"--config.mesh.sampler_processes={samplers}", f"--config.mesh.trainer={mesh}",
            )  # fmt: skip
        env = dict(os.environ, JAXRL_SECRET=secret, PYTHONUNBUFFERED="1")  # the tool knows the secret
        env.setdefault("JAX_PLATFORMS", "cpu")
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [env.get("PYTHONPATH"), workdir])
        )  # chaos_slow_reward
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self._seen = 0  # lines `expect` has looked at
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def _drain(self, timeout_s: float) -> bool:
        """Moves waiting output into `lines`; False once the output has ended."""
        try:
            line = self._q.get(timeout=timeout_s)
        except queue.Empty:
            return True
        while line is not None:
            self.lines.append(line)
            try:
                line = self._q.get_nowait()
            except queue.Empty:
                return True
        self._q.put(None)  # keep the end marker for the next call
        return False

    def expect(self, pattern: str, timeout_s: float, new: bool = False) -> re.Match:
        """Waits for an output line matching `pattern` (with `new`, one after the last match)."""
        deadline = time.monotonic() + timeout_s
        i = self._seen if new else 0
        while True:
            while i < len(self.lines):
                if m := re.search(pattern, self.lines[i]):
                    self._seen = i + 1
                    return m
                i += 1
            if not self._drain(0.02) and i == len(self.lines) or time.monotonic() > deadline:
                break
        raise TimeoutError(f"no line matching {pattern!r}; last lines:\n{''.join(self.lines[-20:])}")

    def wait_until(self, predicate, timeout_s: float) -> bool:
        """Polls `predicate` (reading the output meanwhile) until it holds, the run ends or time is up."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            if not self._drain(0.02) and self.proc.poll() is not None:
                return bool(predicate())
        return False

    def finish(self, timeout_s: float) -> int:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while self._drain(1.0):
            pass
        with open(os.path.join(self.workdir, "launcher.log"), "a") as f:
            f.writelines(self.lines)
        return self.proc.returncode

    def pid_of(self, process: int) -> int:
        return int(self.expect(rf"\[launcher\] process {process}.*: pid (\d+)", 60).group(1))

    def tail(self, n: int = 30) -> str:
        return "".join(self.lines[-n:])


def ledger(workdir: str, steps: int) -> dict:
    """What trained_uids.jsonl says: every version 1..steps present once, no prompt trained twice."""
    rows = _rows(workdir)
    uids = [u for r in rows for u in r["uids"]]
    versions = sorted(r["version"] for r in rows)
    return {"versions_complete": versions == list(range(1, steps + 1)), "prompts_trained": len(uids),
            "prompts_trained_twice": len(uids) - len(set(uids))}  # fmt: skip


def resumed_ledger(workdir: str, steps: int) -> dict:
    """The same after resumes, where a version's last line counts (a version trained, then lost with its
    process before a checkpoint, is trained again): versions 1..steps, each prompt of the epoch once."""
    last = {r["version"]: r["uids"] for r in _rows(workdir)}
    uids = [u for v in sorted(last) for u in last[v]]
    every = {f"0:{r}" for r in range(steps * PROMPTS)}
    return {"versions_complete": sorted(last) == list(range(1, steps + 1)), "prompts_trained": len(uids),
            "prompts_trained_twice": len(uids) - len(set(uids)),
            "prompts_lost": len(every - set(uids))}  # fmt: skip


def _rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "trained_uids.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def committed(workdir: str) -> list[int]:
    """The checkpoint steps on disk (complete ones: orbax renames a step's directory once written)."""
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def final_params(workdir: str):
    """(version, parameter leaves as numpy) of the run's newest checkpoint."""
    import jax
    import numpy as np

    from jaxrl_async.runtime.checkpoint import load_policy
    from jaxrl_async.sharding import SAMPLER_RULES, make_mesh

    mesh = make_mesh((1, 1), ("data", "tensor"), jax.devices("cpu")[:1])
    _, params, _, version = load_policy(workdir, mesh, SAMPLER_RULES)
    return version, [np.asarray(x) for x in jax.tree.leaves(params)]


def _bit_identical(a: str, b: str) -> bool:
    (va, xa), (vb, xb) = final_params(a), final_params(b)
    same = len(xa) == len(xb) and all(x.tobytes() == y.tobytes() for x, y in zip(xa, xb, strict=False))
    return va == vb and same


def random_kills(root: str, steps: int, kills: int, seed: int, heartbeat_s: int, timeout_s: float,
                 secret: str, mode: str = "sync") -> dict:  # fmt: skip
    """SIGKILL of a random process of a 3-process run at a random time, `kills` times, the cluster started
    again with the same command each time; then a run to the end. In sync mode an uninterrupted run of
    the same command is the reference for the final parameters."""
    rng = random.Random(seed)
    workdir = os.path.join(root, "killed")
    extra = [*epoch_flags(steps), f"--config.mode={mode}"]
    done, faults = [], []
    for k in range(kills + 1):
        run = Run(workdir, steps, heartbeat_s, secret, layout=THREE, extra=extra, epochs=1)
        pids = [run.pid_of(i) for i in range(3)]
        start = max(committed(workdir), default=0)
        if k == kills:  # the last start runs to the end
            code = run.finish(timeout_s)
            done.append(code)
            break
        # A random train step after this start's resume point (leaving room for the kills to come), then
        # a random fraction of a second.
        at = start + rng.randint(1, max(1, (steps - 1 - start) // (kills - k)))
        victim, delay = rng.randrange(3), round(rng.uniform(0.0, 0.5), 2)
        try:
            run.expect(rf"step {at} \|", timeout_s)
            time.sleep(delay)
            os.kill(pids[victim], signal.SIGKILL)
            killed = True
        except (TimeoutError, ProcessLookupError):  # the run ended (or failed) before the kill
            killed = False
        t0 = time.monotonic()
        code = run.finish(timeout_s)
        faults.append({"victim": victim, "after_step": at, "delay_s": delay, "killed": killed,
                       "resumed_from": start, "exit_status": code,
                       "cluster_ended_s": round(time.monotonic() - t0, 1)})  # fmt: skip
    final = run
    result = {"scenario": "kills", "seed": seed, "mode": mode, "faults": faults,
              "faults_injected": sum(f["killed"] for f in faults), "final_exit_status": done[-1],
              **resumed_ledger(workdir, steps)}  # fmt: skip
    ok = done[-1] == 0 and result["faults_injected"] == kills and result["versions_complete"]
    ok = ok and result["prompts_lost"] == 0 and result["prompts_trained_twice"] == 0
    if mode == "sync":
        whole = os.path.join(root, "uninterrupted")
        ref = Run(whole, steps, heartbeat_s, secret, layout=THREE, extra=extra, epochs=1)
        ref_code = ref.finish(timeout_s)
        result["bit_identical"] = ref_code == 0 and done[-1] == 0 and _bit_identical(workdir, whole)
        ok = ok and result["bit_identical"]
    result["ok"] = ok
    if not ok:
        result["log_tail"] = final.tail()
    return result


def hung_follower(workdir: str, heartbeat_s: int, timeout_s: float, secret: str) -> dict:
    """SIGSTOP of the trainer follower (process 1 of a 3-process run) after step 1: the learner lead and
    the sampler must each end within heartbeat + 30 s, with a message that names process 1."""
    run = Run(workdir, 1000, heartbeat_s, secret, layout=THREE)
    ended: dict[int, float] = {}
    follower = None
    try:
        follower = run.pid_of(1)
        run.expect(r"step \d+ \|", timeout_s)
        os.kill(follower, signal.SIGSTOP)
        stopped = time.monotonic()

        def others_ended() -> bool:
            for line in run.lines:
                if m := re.search(r"\[launcher\] process ([02]) (exited|was killed)", line):
                    ended.setdefault(int(m.group(1)), round(time.monotonic() - stopped, 1))
            return len(ended) == 2

        run.wait_until(others_ended, heartbeat_s + 90)
    finally:
        try:
            os.kill(follower, signal.SIGKILL)  # (the launcher may have ended it already)
        except (ProcessLookupError, TypeError):
            pass
        code = run.finish(timeout_s)
    # A survivor's own lines ([p0], [p2]) or the launcher's must name process 1 as the cause.
    names = r"stopped sending heartbeats\):\s*(\[p\d\] )?1\s|process 1 \("
    named = {p: bool(re.search(names, "".join(x for x in run.lines if x.startswith(f"[p{p}]")), re.M))
             for p in (0, 2)}  # fmt: skip
    limit = heartbeat_s + 30
    ok = len(ended) == 2 and max(ended.values()) <= limit and all(named.values()) and code != 0
    tail = {} if ok else {"log_tail": run.tail(40)}
    return {"scenario": "hang-follower", "ok": ok, "exit_status": code, "ended_after_s": ended,
            "limit_s": limit, "names_process_1": named, **tail}  # fmt: skip


LIMIT = 1 << 20  # RLIMIT_FSIZE: above the run's logs (a few KiB a step), below a checkpoint's data files
_FAILED = r"checkpoint of version (\d+) failed"


def _limit_writes(pid: int, on: bool) -> None:
    """Caps (or frees) the size of every file process `pid` writes: a write past it fails with EFBIG, as
    on a full disk (Python ignores SIGXFSZ, so the process gets the error, not the signal)."""
    hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (LIMIT if on else hard, hard))


def disk_full_run(workdir: str, steps: int, timeout_s: float, secret: str) -> dict:
    """Checkpoint writes of a running (one-process) run fail; see chaos.py's docstring."""
    extra = epoch_flags(steps)
    run = Run(workdir, steps, 0, secret, layout=None, extra=extra, epochs=1)
    pid, seen, why = run.proc.pid, {}, None
    try:
        if not run.wait_until(lambda: 2 in committed(workdir), timeout_s):
            raise TimeoutError("no checkpoint of version 2")
        _limit_writes(pid, True)
        failed = [int(run.expect(_FAILED, 120, new=True).group(1)) for _ in range(2)]  # warned, retried
        # The run is paused (SIGSTOP) while this tool acts, so that a fast run cannot finish meanwhile.
        os.kill(pid, signal.SIGSTOP)
        good = max(committed(workdir))
        seen = {"failed_versions": failed, "last_good": good,
                "last_good_readable": final_params(workdir)[0] == good}  # fmt: skip
        _limit_writes(pid, False)  # space again: a later save must succeed
        os.kill(pid, signal.SIGCONT)
        seen["saved_after_freed"] = run.wait_until(lambda: max(committed(workdir)) > good, 120)
        os.kill(pid, signal.SIGSTOP)
        _limit_writes(pid, True)  # full again: the rest of the saves fail, the final one (it waits) too
    except (TimeoutError, ProcessLookupError) as e:
        why = str(e)[-2000:]
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    code = run.finish(timeout_s)
    text = "".join(run.lines)
    first = next((i for i, line in enumerate(run.lines) if re.search(_FAILED, line)), len(run.lines))
    seen["trained_after_failures"] = any(re.search(r"step \d+ \|", line) for line in run.lines[first:])
    stop = re.search(r"could not be written .*the last good checkpoint is version (\d+)", text)
    on_disk = os.listdir(os.path.join(workdir, "checkpoints"))
    seen.update({"exit_status": code, "stopped_with_message": bool(stop), "partial_dirs": [
        n for n in on_disk if not n.isdigit() and n != "model.json"]})  # fmt: skip
    last = max(committed(workdir))
    again = Run(workdir, steps, 0, secret, layout=None, extra=extra, epochs=1)
    code2 = again.finish(timeout_s)
    resumed = re.search(r"resumed from \S+ at version (\d+)", "".join(again.lines))
    seen.update({"resume_exit_status": code2, "resumed_at": int(resumed.group(1)) if resumed else None,
                 "last_committed": last, **resumed_ledger(workdir, steps)})  # fmt: skip
    ok = why is None and code != 0 and stop is not None and int(stop.group(1)) == last
    checks = ("trained_after_failures", "last_good_readable", "saved_after_freed")
    ok = ok and all(seen.get(k) for k in checks)
    ok = ok and not seen["partial_dirs"] and code2 == 0 and seen["resumed_at"] == last
    ok = ok and seen["versions_complete"] and seen["prompts_lost"] == seen["prompts_trained_twice"] == 0
    return {"scenario": "disk-run", "ok": ok, **seen,
            **({} if ok else {"error": why, "log_tail": run.tail(40) + again.tail(20)})}  # fmt: skip
