"""Each role of a run measured alone (`calibrate_roles`) or beside the other role running in a second
process (`corun_role`), with the run's own devices, model, data and rewards.

Inputs of the shared-host performance model (`jaxrl_async.perf.shared_host`): how long the sampler takes
to produce one train batch (from empty slots to the last graded sample, as sync RL does, and at the
steady rate of a never-drained stream, as async RL does), how long one train step plus its weight sync
takes, and how much of the host's cores each keeps busy meanwhile (process CPU seconds, which include
XLA's worker threads). Part of the orchestrator layer: it builds the run's own actor, coordinator and
trainer (`jaxrl_async.runtime.build.build_process`) and drives them one at a time through their
messages (`benchmarks/bench_roles.py` is the CLI). Where two processes share a core, `corun_role` gives each
role's pace while the other runs: the shared paces of `shared_host.predict_lent_core`.
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from typing import Any

from jaxrl_async.runtime.messages import Rollouts, Trained
from jaxrl_async.trainer.train_step import prepare_batch

_UNLIMITED = 10**6  # versions to open the admission window by: the stream never waits for training


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def calibration_config(config):
    """The run's config as `calibrate_roles` measures it: sync mode (η = 0), so that each version the
    coordinator hears of opens exactly one batch of prompts. Build the roles from this
    (`build.build_local`)."""
    c = config.copy_and_resolve_references()
    c.mode, c.max_staleness = "sync", 0
    return c


class _Driver:
    """Runs the actor and the coordinator of a one-process run and collects the actor's groups.

    The coordinator runs with η = 0 (`calibration_config`), so each new version it hears of opens exactly
    one batch of prompts.
    """

    def __init__(self, proc):
        self.actor, self.coordinator = proc.actor, proc.coordinator
        self.transport = proc.actor.transport
        self.version = proc.coordinator.version
        self.groups: list = []

    def open(self, versions: int) -> None:
        self.version += versions
        self.transport.send("coordinator", Trained(self.version, []))

    def until(self, n_groups: int) -> None:
        while len(self.groups) < n_groups:
            self.actor.poll()
            self.coordinator.poll()
            for m in self.transport.recv("learner"):
                if isinstance(m, Rollouts):
                    self.groups += m.groups


def calibrate_roles(proc, batches: int = 6) -> dict[str, Any]:
    """Measures the sampler and the trainer of a built one-process run, one at a time.

    Args:
      proc: `jaxrl_async.runtime.build.build_process` of a one-process run; its train state is
        updated by the timed steps.
      batches: timed train batches per measurement (one more, untimed, compiles first).

    Returns:
      A dict (the role-bench JSON of `jaxrl_async.perf.shared_host.RoleBench`) with per-batch medians:
      `sample_batch_s` / `sample_batch_cpu_s` (one batch from empty slots to its last graded sample),
      `sample_stream_s` / `sample_stream_cpu_s` (seconds per batch of samples while admission never
      stops), `train_step_s` / `train_step_cpu_s` (prepare + train step + reshard onto the sampler mesh,
      per packed micro-batch times the mean micro-batches of a batch: `train_micro_batch_s`,
      `train_micro_batches`; the timed steps' own median is `train_step_measured_s`), `update_s` (the
      sampler swapping in new weights), batch sizes, lengths of the sync batches and the core count.
    """
    if batches < 2:
        raise ValueError(f"batches must be >= 2, got {batches}")
    run = proc.run
    if run.schedule.effective_max_staleness != 0:
        raise ValueError("calibrate_roles: build the roles from calibration_config(config) (config.mode="
                         f"'sync'), got config.mode={run.schedule.mode!r}")  # fmt: skip
    b = run.schedule.prompts_per_step
    n = b * run.schedule.samples_per_prompt
    proc.actor.eval_schedule.prompts = []  # nothing to evaluate: this measures sampling
    drive = _Driver(proc)

    # Sync-style: one batch at a time, from empty slots to the last graded sample.
    # Version 0 already admits its B prompts; each later batch opens one more version (opening one
    # before the first batch would put two batches in flight and time the faster half of them).
    batch_times = []
    for i in range(batches + 1):
        if i:
            drive.open(1)
        t = _timed(lambda i=i: drive.until((i + 1) * b))
        if i:  # the first batch compiles
            batch_times.append(t)
    sync_groups = drive.groups[b:]  # every prompt drained to its last token: lengths unbiased
    # Async-style: admission never stops; time `batches` batches' worth after one batch of fill-up.
    drive.open(_UNLIMITED)
    start = len(drive.groups)
    drive.until(start + b)
    stream = _timed(lambda: drive.until(start + (batches + 1) * b))

    train_batches = [drive.groups[i : i + b] for i in range(0, len(drive.groups) - b + 1, b)]
    lengths = [len(r.completion_tokens) for g in sync_groups for r in g]
    core, loop = proc.learner.core, proc.actor.loop
    train_times, micros, update_times = [], [], []
    for i, groups in enumerate(train_batches[: batches + 1]):
        micros.append(
            prepare_batch(core.train_cfg, [r for g in groups for r in g], core.row_segment_cap).num_micro
        )
        out = []

        def step(groups=groups, out=out):
            metrics, _ = core.dispatch(groups)
            out.append(core.publish())

        t = _timed(step)
        message = out[0]
        u = _timed(lambda m=message: loop.update_params(m.params, m.version, run.sampler.update_mode))
        if i:
            train_times.append(t)
            update_times.append(u[0])
    med = lambda xs: float(statistics.median(xs))
    micro_s = med([t / m for (t, _), m in zip(train_times, micros[1:], strict=True)])
    tokens, expected_micro = _steady_batches(core.train_cfg, sync_groups, b, core.row_segment_cap)
    return {
        "sampler_devices": run.mesh.sampler_devices,
        "trainer_devices": run.mesh.trainer_devices,
        "colocated": bool(run.mesh.colocate),
        "cores": host_cores(),
        "num_slots": run.sampler.num_slots,
        "steps_per_call": run.sampler.steps_per_call,
        "samples_per_batch": n,
        "max_staleness": run.schedule.effective_max_staleness,
        "tokens_per_batch": tokens,
        "completion_length_mean": float(statistics.fmean(lengths)),
        "sync_batch_groups": len(sync_groups) / batches,  # B when one batch at a time was in flight
        "sample_batch_s": med([w for w, _ in batch_times]),
        "sample_batch_cpu_s": med([c for _, c in batch_times]),
        "sample_stream_s": stream[0] / batches,
        "sample_stream_cpu_s": stream[1] / batches,
        "train_step_s": micro_s * expected_micro,
        "train_step_cpu_s": med([c / m for (_, c), m in zip(train_times, micros[1:], strict=True)])
        * expected_micro,
        "train_micro_batch_s": micro_s,
        "train_micro_batches": expected_micro,
        "train_step_measured_s": med([w for w, _ in train_times]),
        "update_s": med(update_times),
        "batches": batches,
    }


class Rendezvous:
    """Where two co-run processes (`corun_role`) meet: marker files in a directory both can see.

    Each marks itself ready once compiled and waits for the other, so the timed windows overlap; after its
    window it marks itself done and keeps working until the other is done too, so the other's window is
    contended to its end. A peer that never shows up ends the wait with an error that names it.
    """

    def __init__(self, root: str, me: str, peer: str, timeout_s: float = 900.0):
        self.root, self.me, self.peer, self.timeout_s = root, me, peer, timeout_s

    def _path(self, who: str, what: str) -> str:
        return os.path.join(self.root, f"{who}.{what}")

    def mark(self, what: str) -> None:
        open(self._path(self.me, what), "w").close()

    def seen(self, what: str) -> bool:
        return os.path.exists(self._path(self.peer, what))

    def wait(self, what: str, work=None) -> None:
        """Until the peer has marked `what`, calling `work()` meanwhile (or sleeping)."""
        deadline = time.monotonic() + self.timeout_s
        while not self.seen(what):
            if time.monotonic() > deadline:
                raise RuntimeError(f"co-run: {self.peer} not {what} after {self.timeout_s:.0f} s "
                                   f"(no {self._path(self.peer, what)})")  # fmt: skip
            work() if work else time.sleep(0.05)


def corun_role(proc, role: str, seconds: float, meet: Rendezvous) -> dict[str, Any]:
    """Times one role of a built one-process run while the other role runs in a second process beside it.

    Alone, each role's bench (`calibrate_roles`) leaves the cores to it; where the two share a core (the
    sampler's core lent to the learner: `jaxrl-local-cluster --cpu-sets=0,1:1`) each slows the other, and
    by how much depends on the scheduler and on XLA's thread pool, not on a formula. The two processes
    meet (`meet`) once compiled, then each runs its role without pause: the sampler streams with admission
    never closed, the trainer steps on batches it sampled before the meeting. The window is the first
    `seconds` after the meeting, rounded up to a whole step or group.

    Returns:
      {"role", "window_s"} and, for the sampler, `sample_stream_s` (seconds per train batch of samples),
      for the trainer, `train_micro_batch_s` (seconds per packed micro-batch of train step + weight sync)
      and `train_steps`.
    """
    import jax

    if role not in ("sampler", "trainer"):
        raise ValueError(f"co-run role must be 'sampler' or 'trainer', got {role!r}")
    if seconds <= 0:
        raise ValueError(f"co-run seconds must be > 0, got {seconds}")
    b = proc.run.schedule.prompts_per_step
    proc.actor.eval_schedule.prompts = []
    drive = _Driver(proc)
    drive.open(_UNLIMITED)
    more = lambda: drive.until(len(drive.groups) + 1)  # noqa: E731  one more group
    if role == "sampler":
        drive.until(b)  # compiled and every slot busy
        meet.mark("ready")
        meet.wait("ready")
        n0, t0 = len(drive.groups), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            more()
        window, out = time.perf_counter() - t0, {}
        out["sample_stream_s"] = window / ((len(drive.groups) - n0) / b)
    else:
        drive.until(2 * b)  # two batches to step on in turn
        batches = [drive.groups[:b], drive.groups[b : 2 * b]]
        core = proc.learner.core
        cap = core.row_segment_cap
        micros = [prepare_batch(core.train_cfg, [r for g in bt for r in g], cap).num_micro for bt in batches]

        def step(i: int) -> None:
            core.dispatch(batches[i % 2])
            jax.block_until_ready(core.publish().params)

        step(0)  # compiles
        meet.mark("ready")
        meet.wait("ready")
        steps, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step(steps)
            steps += 1
        window = time.perf_counter() - t0
        done_micros = sum(micros[i % 2] for i in range(steps))
        out = {"train_micro_batch_s": window / done_micros, "train_steps": steps}
        later = itertools.count(steps)
        more = lambda: step(next(later))  # noqa: E731
    meet.mark("done")
    meet.wait("done", more)  # the peer's window stays contended to its end
    return {"role": role, "window_s": window, **out}


def _steady_batches(
    train_cfg, groups: list, b: int, row_segment_cap: int | None = None, draws: int = 200
) -> tuple[float, float]:
    """Mean trained tokens and packed micro-batches of a train batch of `b` groups drawn from `groups`.

    A step costs its padded micro-batches, not its tokens: a batch a few tokens over a micro-batch
    boundary pays a whole extra one. The timed steps' own batches are too few (and the stream's first
    ones too short) to give the mean, so batches are resampled from completed sync groups and packed
    exactly as the trainer packs them.
    """
    rng = random.Random(0)
    tokens, micro = [], []
    for _ in range(draws):
        rollouts = [r for g in rng.choices(groups, k=b) for r in g]
        tokens.append(sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts))
        micro.append(prepare_batch(train_cfg, rollouts, row_segment_cap).num_micro)
    return float(statistics.fmean(tokens)), float(statistics.fmean(micro))


def decode_curve(proc, batches=(1, 4, 16, 64)) -> dict[str, Any]:
    """Decode step seconds of a built one-process run's sampler: its own engine with b busy slots (a
    static-shape engine costs about the same whatever b), and an engine of only b slots (the t(b) of an
    engine that pays for busy slots only). The split model's latency input (`perf.calibrated`)."""
    import dataclasses

    from jaxrl_async.runtime import build

    run, engine = proc.run, proc.actor.engine
    params = proc.learner.core.publish().params  # the current weights in the sampler layout
    engine.update_params(params, 0)
    slots = engine.cfg.num_slots
    sizes = sorted({b for b in batches if b < slots} | {slots})
    out: dict[str, Any] = {"slots": slots, "busy_of_run_engine": [], "engine_of_b_slots": []}
    for b in sizes:
        out["busy_of_run_engine"].append([b, decode_step_s(engine, b)])
        few = dataclasses.replace(engine.cfg, num_slots=b, token_budget=b * engine.cfg.slot_len)
        small = build.build_engines(run, proc.actor.engine.model_cfg, engine.mesh, few)[0]
        small.update_params(params, 0)
        out["engine_of_b_slots"].append([b, decode_step_s(small, b)])
    return out


def decode_step_s(engine, busy: int, calls: int = 20) -> float:
    """Median seconds per decode step of `engine` with `busy` of its slots running (the rest empty)."""
    import numpy as np

    state = engine.init_state()
    prefix = engine.prefill(np.arange(1, engine.cfg.max_prompt_len + 1) % engine.model_cfg.vocab_size)
    for b in range(busy):
        state = engine.insert(
            state, prefix, b, seed=b, sample_index=0, max_new_tokens=engine.cfg.max_new_tokens
        )
    times = []
    for _ in range(calls + 2):
        t0 = time.perf_counter()
        state, rnd = engine.generate(state)
        rnd.tokens.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times[2:])) / engine.cfg.steps_per_call
