"""The orchestrator: runs the roles of this process (`jaxrl_async.runtime.build.build_process` puts them
together) in one event loop, until the learner lead says the run is over.

Data flows one way: prompts (coordinator) -> actors (decode, grade) -> learner (train) -> weights ->
actors. A run is one program on every process; `jaxrl_async.runtime.cluster.Roles` says which roles
this process plays:

  one process          coordinator + learner + actor 0, in-memory transport, weights by device_put
  learner lead         coordinator + learner (+ the message hub, TensorBoard, checkpoint primary)
  other trainer        a follower running the lead's SPMD steps on its share of the trainer mesh
  sampler process      one actor over its own devices
  replica leader       one actor over a replica that spans processes: it tells the other members what to
                       run (jaxrl_async.runtime.replica)
  replica member       the leader's decode calls, replayed on its share of the replica's mesh

Every role is a `poll()` that never blocks on another role; the loop polls the roles of this process until
the learner lead says the run is over. `mode="sync"` is the same code with η = 0.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from typing import Any

from jaxrl_async import storage
from jaxrl_async.run_config import ConfigError, validate
from jaxrl_async.runtime import compile_cache, secret
from jaxrl_async.runtime.build import Process, build_process, make_transport, single_process
from jaxrl_async.runtime.cluster import Cluster
from jaxrl_async.runtime.evaluation import trainer_idle_during
from jaxrl_async.runtime.messages import Preempt

log = logging.getLogger(__name__)

STALL_WARNING_S = 60.0  # log every role's state after this long without progress


class _StopSignals:
    """SIGTERM / SIGINT ask the run to save and stop (the learner lead does it); a second SIGINT aborts."""

    def __init__(self):
        self.received: str | None = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _event_loop(proc: Process, transport, signals: _StopSignals) -> None:
    """Polls this process's roles until its part of the run is over."""
    cluster = proc.cluster
    done = (
        (lambda: proc.learner.done)
        if proc.learner is not None
        else (lambda: proc.actor.done)
        if proc.actor is not None
        else (lambda: proc.member.done)
        if proc.member is not None
        else (lambda: proc.follower.done)
    )
    # A member sleeps on its leader's channel: the next decode call's command ends the wait at once.
    wait = proc.member.wait if proc.member is not None else transport.wait
    asked_to_stop = False
    last = time.monotonic()
    while not done():
        if signals.received and not asked_to_stop:
            asked_to_stop = True
            if proc.learner is not None:
                proc.learner.preempt(f"{signals.received} received")
            else:
                transport.send("learner", Preempt(cluster.process_id, signals.received))
        progress = False
        for role in proc.roles:
            progress = role.poll() or progress
        cluster.check_peers()
        now = time.monotonic()
        if progress:
            last = now
        else:
            wait(0.002) if cluster.roles.multi else time.sleep(0.0005)
            if now - last > STALL_WARNING_S:  # say what every role waits for (a slow step, or a bug)
                log.warning(
                    "no progress for %.0f s: %s", now - last, " | ".join(r.describe() for r in proc.roles)
                )
                last = now


def run_from_config(config, cluster: Cluster | None = None) -> dict[str, Any] | None:
    """Validates `config`, builds this process's roles and runs them; the entry point of launch/run.py.

    Returns the run summary on the learner lead (also written to workdir/summary.json), None elsewhere.
    """
    cluster = cluster or single_process()
    run = validate(config, num_devices=None)  # fail on the config before connecting anything
    try:  # before anything compiles (the warm start included), so that every compile can use it
        cache = compile_cache.enable(run.compile_cache_dir) if run.compile_cache_dir else None
    except compile_cache.CacheError as e:
        raise ConfigError(str(e)) from None
    key = secret.load() if cluster.roles.multi else None  # it leaves the environment here
    transport = make_transport(cluster, key)
    proc = None
    signals = _StopSignals()
    try:
        proc = build_process(config, cluster, transport, key, cache and cache.store)
        t0 = time.perf_counter()
        _event_loop(proc, transport, signals)
        if cache is not None:
            log.info(cache.log_line())
        if proc.learner is None:
            return None
        return _summary(proc, time.perf_counter() - t0, cache)
    finally:
        signals.restore()
        if proc is not None:
            proc.close()
        transport.close()


def _summary(proc: Process, wall: float, cache: compile_cache.CacheUse | None) -> dict[str, Any]:
    run, learner = proc.run, proc.learner
    actor0 = learner.reports.final.get(0)
    summary = {
        "mode": run.schedule.mode,
        "max_staleness": run.schedule.effective_max_staleness,
        "loss": run.trainer.loss,
        "processes": proc.cluster.roles.num_processes,
        "wall_s": wall,
        **learner.summary(),
        **proc.coordinator.summary(),
        "warm_start": proc.warm_start_info,
        # this process's compiles (the learner lead's): how many the persistent cache answered
        "compile_cache": cache and cache.report(),
        # each sampler process's own executables (processes other than 0, which JAX writes nothing for)
        "sampler_executables": {f"actor:{i}": s.executables for i, s in learner.reports.final.items()
                                if s.executables},  # fmt: skip
        "reward_stats": actor0 and actor0.reward_stats,
        "eval_spans": actor0 and actor0.eval_spans,
        "sample_calls_during_eval": actor0 and actor0.sample_calls_during_eval,
        "trainer_during_eval": trainer_idle_during(actor0 and actor0.eval_spans, learner.step_spans),
        # replicas that span processes: when each member applied each version, the tokens it decoded
        "replicas": {f"actor:{i}": s.replica for i, s in learner.reports.final.items() if s.replica},
        # what each sampler process received: bytes per version (and a LoRA run's base, once)
        "weight_bytes": {f"actor:{i}": s.weight_bytes for i, s in learner.reports.final.items()},
    }
    path = storage.join(run.workdir, "summary.json")
    if proc.resumed_at is not None:
        summary.update(with_earlier_evals(path, proc.resumed_at, summary["evals"]))
    storage.write_text(path, json.dumps(summary, indent=2, default=str))
    return summary


def with_earlier_evals(path: str, resumed_at: int, evals: list[dict]) -> dict[str, Any]:
    """A resumed run's `evals`, `initial_accuracy` and `resumed_at` for summary.json: the evaluations the
    earlier processes left in `path` (the summary a stopped run writes) at versions up to `resumed_at` that
    this process did not evaluate again, in front of its own, so that the summary covers the whole run
    (TensorBoard's event files already do). An earlier entry's `elapsed_s` and `trained_s` count from its
    own process's start; `resumed_at` lists the version each resume restored. A run killed before it wrote
    a summary leaves none: its evaluations are then only in TensorBoard (logged)."""
    before: dict = {}
    if storage.exists(path):
        try:
            before = json.loads(storage.read_text(path))
        except ValueError as e:
            log.warning("%s is unreadable (%s): the summary holds this process's evaluations only", path, e)
    else:
        log.warning("no %s from before the resume at version %d: the earlier evaluations are in "
                    "TensorBoard only", path, resumed_at)  # fmt: skip
    again = {e["step"] for e in evals}
    rows = before.get("evals") if isinstance(before, dict) else None
    earlier = [e for e in rows or () if isinstance(e, dict) and isinstance(e.get("step"), int)
               and e["step"] <= resumed_at and e["step"] not in again]  # fmt: skip
    merged = sorted(earlier, key=lambda e: e["step"]) + list(evals)
    resumes = before.get("resumed_at") if isinstance(before, dict) else None
    return {
        "evals": merged,
        "initial_accuracy": merged[0]["accuracy"] if merged else None,
        "resumed_at": [*(r for r in resumes or () if isinstance(r, int) and r < resumed_at), resumed_at],
    }
