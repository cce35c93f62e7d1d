"""The learner: owns the train state, turns finished groups into train steps, publishes every new version.

The learner lead (the first trainer process) receives the actors' groups, keeps them in the rollout queue
(oldest start version first), and decides each batch. With several trainer processes it sends the batch to
the others (`TrainBatch`) before running the step itself: every trainer process then runs the same SPMD
step over the trainer mesh, each contributing its shard of the global batch, and publishes its shards of
the new weights. Only the lead logs (TensorBoard) and tells the coordinator what was trained.

The lead never blocks on the device: it dispatches a step (JAX dispatches asynchronously) and finishes it
in a later `poll()` once its outputs are ready, handling messages in between.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxrl_async.envs.metrics import rollout_values, tool_values
from jaxrl_async.model import attention
from jaxrl_async.rollouts import GroupFilter, NonFiniteSteps, Rollout, RolloutQueue, staleness_stats
from jaxrl_async.run_config import CheckpointSection, LogSection, Schedule
from jaxrl_async.runtime.cluster import Roles
from jaxrl_async.runtime.lag import publish_all
from jaxrl_async.runtime.learner_log import (
    SUMMARY_KEYS,
    ActorReports,
    SavePolicy,
    StepClock,
    StepLog,
    completion_values,
    drift_summary,
    drift_values,
    staleness_values,
    steady_rate,
    train_values,
)
from jaxrl_async.runtime.messages import (
    EvalResult,
    Preempt,
    Rollouts,
    SaveCheckpoint,
    Stop,
    Stopped,
    TrainBatch,
    Trained,
)
from jaxrl_async.runtime.metrics import MetricsWriter, summary_line
from jaxrl_async.runtime.schedule_log import NoSchedule
from jaxrl_async.trainer import prepare_batch, train_step

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """What the learner needs to know of the run.

    Attributes:
      schedule: the run's Schedule (prompts_per_step = B groups per batch, samples_per_prompt = G,
        total_steps = versions to train, max_head_staleness = drop groups older than this when trained).
      log: the run's LogSection (log every, text samples).
      checkpoint: the run's CheckpointSection (when to save). Training never waits for an evaluation
        (actor 0 runs them beside sampling; the lead waits only for the last one, before stopping): a
        checkpoint due at an evaluated version carries its accuracy (for the best-checkpoint policy) only
        if that evaluation had finished; the final checkpoint always does.
      roles: which process plays which role (the other trainer processes follow the lead's steps; every
        actor gets each version).

    Dynamic sampling (trainer.dynamic_sampling and its patience) is the TrainConfig's, read from the
    core's `train_cfg`: uninformative groups are discarded as they arrive and the coordinator admits a new
    prompt for each; patience batches' worth in a row stop the run.
    """

    schedule: Schedule
    log: LogSection
    checkpoint: CheckpointSection
    roles: Roles

    @property
    def followers(self) -> tuple[str, ...]:
        """Endpoints of the other trainer processes."""
        return tuple(f"trainer:{p}" for p in self.roles.trainers[1:])

    @property
    def actors(self) -> int:
        return len(self.roles.samplers)


class TrainerCore:
    """What every trainer process holds: the train state, the step, the weight publisher, checkpoints."""

    def __init__(self, state, train_cfg, publisher, checkpoints):
        self.state, self.train_cfg, self.publisher, self.checkpoints = (
            state,
            train_cfg,
            publisher,
            checkpoints,
        )
        model_cfg = state.model_cfg  # its dtype is the compute dtype (train_step._with_compute_dtype)
        # cuDNN's packed attention is built for a fixed number of sequences per row: pack no more.
        self.row_segment_cap = attention.row_segment_cap(
            model_cfg.attention, model_cfg.dtype, train_cfg.token_budget, model_cfg.platform
        )

    @property
    def version(self) -> int:
        return int(np.asarray(self.state.version.addressable_shards[0].data))

    def dispatch(self, groups: list[list[Rollout]]):
        """Starts one train step on `groups` (asynchronously); returns (metrics, zero-adv skipped count)."""
        rollouts = [r for g in groups for r in g]
        batch = prepare_batch(self.train_cfg, rollouts, self.row_segment_cap)
        self.state, metrics = train_step(self.state, batch)
        return metrics, batch.num_skipped

    def publish(self):
        """Offers the current weights to the actors; returns the `NewWeights` message."""
        return self.publisher.publish(self.version, self.state.params)

    def publish_all(self):
        """The `NewWeights` messages for the current version, in order: one, none, or (a controlled-lag
        run's last version, runtime/lag.py) the due versions the samplers skipped, then the last. Lazy:
        send each before taking the next. Every trainer process takes them all, in the same order."""
        return publish_all(self.publisher, self.version, self.state.params)

    def save(self, coordinator_state: dict, metrics: dict | None = None, wait: bool = False) -> float:
        """Checkpoints the current version; returns the seconds the caller was held (see RunCheckpoints)."""
        if self.checkpoints is None:
            return 0.0
        return self.checkpoints.save(self.version, self.state, coordinator_state, metrics, wait)


@dataclasses.dataclass
class _InFlight:
    groups: list[list[Rollout]]
    metrics: dict
    skipped: int
    started: float


@dataclasses.dataclass
class _Totals:
    """What the learner gathers over the run for its final summary."""

    evals: list = dataclasses.field(default_factory=list)  # (version, accuracy, elapsed, expected reward)
    checksums: dict = dataclasses.field(default_factory=dict)  # version -> checksum the samplers got
    eval_s: float = 0.0  # seconds actor 0 spent evaluating
    trained_tokens: int = 0
    checkpoint_stall_s: list = dataclasses.field(default_factory=list)  # each save's hold on training


class Learner:
    """The learner lead (see the module docstring).

    Args:
      cfg: the learner's settings.
      core: the train state, step, publisher and checkpoints.
      transport: the run's transport; this role reads "learner".
      writer: TensorBoard (the lead is the run's only writer).
      coordinator_state: returns the coordinator's state for a checkpoint (same process, same thread).
      schedule: records each train step's groups and version (`schedule_log.LearnerSchedule`); None: none.
    """

    endpoint = "learner"

    def __init__(self, cfg: LearnerConfig, core: TrainerCore, transport, writer: MetricsWriter,
                 coordinator_state: Callable[[], dict], schedule=None):  # fmt: skip
        self.cfg, self.core, self.transport, self.writer = cfg, core, transport, writer
        self.schedule = schedule or NoSchedule()
        self.coordinator_state = coordinator_state
        self.queue = RolloutQueue(cfg.schedule.samples_per_prompt, cfg.schedule.max_head_staleness)
        self.version = core.version
        self.inflight: _InFlight | None = None
        self.reports = ActorReports(cfg.actors)
        self.totals = _Totals()
        self.log = StepLog(writer, cfg.log.text_samples)
        self.done = False
        self.data_exhausted = False
        self.preempting = False
        train_cfg = core.train_cfg
        patience = train_cfg.dynamic_sampling_patience * cfg.schedule.prompts_per_step
        self.filter = GroupFilter(train_cfg.dynamic_sampling, patience)
        self.groups_received = 0  # for the stall warning: where groups stop
        self.no_signal = False
        self.non_finite = NonFiniteSteps()
        self.save_policy = SavePolicy(cfg.checkpoint.every, cfg.checkpoint.minutes, cfg.schedule.total_steps,
                                      saved_at=time.monotonic())  # fmt: skip
        self._stop_sent = False
        self.clock = StepClock()
        self.schedule.started(self.version, core.state.params)
        self._publish()

    # ----- the event loop -----

    def poll(self) -> bool:
        progress = False
        for m in self.transport.recv(self.endpoint):
            progress = True
            if isinstance(m, Rollouts):
                self._take_groups(m.groups)
                self.reports.update(m.actor, m.stats)
            elif isinstance(m, EvalResult):
                self._record_eval(m)
            elif isinstance(m, Stopped):
                self.reports.update(m.actor, m.stats, final=True)
            elif isinstance(m, Preempt):
                self.preempt(f"process {m.process_id} got {m.signal}")
            else:
                raise TypeError(f"learner: unexpected message {type(m).__name__}")
        if self.inflight is not None and _ready(self.inflight.metrics):
            self._finish()
            progress = True
        busy = self.inflight is not None
        more = self.version < self.cfg.schedule.total_steps
        if not busy and not (self.preempting or self.no_signal or self.non_finite.stop) and more:
            groups = self.queue.pop_batch(self.cfg.schedule.prompts_per_step, self.version)
            self._report_drops()
            if groups is not None:
                self._dispatch(groups)
                progress = True
            elif self.reports.all_drained:
                log.warning("data exhausted after %d steps", self.version)
                self.data_exhausted = True
        self._maybe_stop()
        return progress

    def preempt(self, why: str) -> None:
        """Stop after the step in flight: save, then end the run (SIGTERM / SIGINT on any process)."""
        if not self.preempting:
            log.warning("%s: saving after the step in flight, then stopping", why)
        self.preempting = True

    def _take_groups(self, groups: list[list[Rollout]]) -> None:
        """Queues finished groups; with dynamic sampling, uninformative ones are discarded and reported to
        the coordinator (which returns their budget and admits new prompts in their place)."""
        self.groups_received += len(groups)
        kept, filtered = self.filter.split(groups)
        for g in kept:
            self.queue.add_group(g)
        if not filtered:
            return
        self.transport.send("coordinator", Trained(self.version, [], filtered=filtered))
        self.reports.work_coming()
        if self.filter.exhausted and not self.no_signal:
            log.error(
                "dynamic sampling: the last %d groups all had equal rewards (trainer.dynamic_sampling_"
                "patience=%d batches); no learning signal is left, stopping at version %d",
                self.filter.in_a_row, self.core.train_cfg.dynamic_sampling_patience, self.version,
            )  # fmt: skip
            self.no_signal = True

    def _report_drops(self) -> None:
        """Groups the queue dropped as too stale go back to the coordinator at once (started again)."""
        if self.queue.dropped_ids:
            self.transport.send("coordinator", Trained(self.version, [], self.queue.dropped_ids))
            self.queue.dropped_ids = []
            self.reports.work_coming()

    def _eval_of(self, version: int) -> float | None:
        return next((e[1] for e in reversed(self.totals.evals) if e[0] == version), None)

    def _dispatch(self, groups) -> None:
        now = self.clock.dispatch()
        for f in self.cfg.followers:
            self.transport.send(f, TrainBatch(self.version + 1, groups))
        metrics, skipped = self.core.dispatch(groups)
        self.inflight = _InFlight(groups, metrics, skipped, now)

    def _finish(self) -> None:
        step, self.inflight = self.inflight, None
        metrics = {k: float(np.asarray(v.addressable_shards[0].data)) for k, v in step.metrics.items()
                   if np.ndim(v) == 0}  # fmt: skip
        step_s = time.perf_counter() - step.started
        version = self.core.version
        self.schedule.trained(version, step.groups, self.core.state.params)
        self.non_finite.record(finite=version != self.version)
        if version == self.version:  # every update was skipped (non-finite): nothing new to publish
            self.clock.idle()
            self._non_finite(step.groups, metrics)
            return
        self.version = version
        self.clock.trained(version)
        sync = self._publish()
        self.clock.idle()
        rollouts = [r for g in step.groups for r in g]
        self.totals.trained_tokens += sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts)
        self.transport.send("coordinator", Trained(version, [g[0].group_id for g in step.groups]))
        metrics["zero_adv_skipped_frac"] = step.skipped / max(len(rollouts), 1)
        values = self._log_step(step.groups, metrics, step_s, sync)
        if self.version % self.cfg.log.every == 0:
            log.info(summary_line(self.version, values, SUMMARY_KEYS))
        # At once, even before this version's evaluation is in: waiting for it would idle the trainer.
        if self.save_policy.due(self.version, time.monotonic()):
            self.save()

    def _non_finite(self, groups, metrics: dict[str, float]) -> None:
        """A step changed no weight: its groups go back to the coordinator to be sampled again (on the
        admission budget they hold; the version, on which admission waits, did not move), and enough such
        steps in a row stop the run. The warning gives the step's loss and gradient norm: a finite loss
        with a non-finite gradient points at a backward pass, not at the data."""
        self.transport.send("coordinator", Trained(self.version, [], dropped=[g[0].group_id for g in groups]))
        log.warning(
            "version %d: every update of the step on %d groups had a non-finite loss or gradient and was "
            "skipped (loss %s, gradient norm %s); the groups are sampled again (%d such steps in a row, %d "
            "stop the run)",
            self.version, len(groups), metrics.get("loss"), metrics.get("grad_norm"),
            self.non_finite.in_a_row, self.non_finite.limit,
        )  # fmt: skip
        if self.non_finite.stop:
            log.error(
                "%d train steps in a row were non-finite: stopping at version %d (its weights are the last "
                "finite ones and are saved); lower config.trainer.lr or check the data and rewards",
                self.non_finite.in_a_row, self.version,
            )  # fmt: skip

    def _publish(self) -> float:
        """Sends this version's messages (none when a controlled lag's version was already sent, several
        at a lagged run's end: runtime/lag.py); returns the seconds their publishing took."""
        seconds = 0.0
        for message in self.core.publish_all():
            if message.checksum is not None:
                self.totals.checksums[message.version] = message.checksum
            for a in range(self.cfg.actors):
                self.transport.send(f"actor:{a}", message)
            seconds += self.core.publisher.last_seconds
        return seconds

    def save(self, final: bool = False) -> None:
        """Checkpoints the train state with the coordinator's state, on every trainer process, with the
        version's held-out accuracy when known (the checkpoints keep the best one by it)."""
        state = self.coordinator_state()
        acc = self._eval_of(self.version)
        metrics = None if acc is None else {"eval_accuracy": acc}
        for f in self.cfg.followers:
            self.transport.send(f, SaveCheckpoint(self.version, state, metrics, final))
        held = self.core.save(state, metrics, wait=final)
        self.totals.checkpoint_stall_s.append(held)
        failed = self.core.checkpoints.failures if self.core.checkpoints is not None else 0
        self.writer.scalars(
            self.version, {"perf/checkpoint_stall_s": held, "perf/checkpoint_failures": failed}
        )
        self.save_policy.saved_at = time.monotonic()

    def _record_eval(self, m: EvalResult) -> None:
        self.totals.eval_s += m.seconds
        elapsed = self.elapsed()
        self.totals.evals.append((m.version, m.accuracy, elapsed, m.expected_reward))
        self.writer.scalars(m.version, {"eval/accuracy": m.accuracy})
        if m.expected_reward is None:
            log.info("version %d: held-out accuracy %.3f", m.version, m.accuracy)
            return
        self.writer.scalars(m.version, {"eval/expected_reward": m.expected_reward,
                                        "eval/expected_reward_stderr": m.expected_reward_stderr})  # fmt: skip
        log.info("version %d: held-out accuracy %.3f, expected reward %.4f +- %.4f", m.version, m.accuracy,
                 m.expected_reward, m.expected_reward_stderr)  # fmt: skip

    def _maybe_stop(self) -> None:
        quit_now = self.data_exhausted or self.preempting or self.no_signal or self.non_finite.stop
        finished = self.version >= self.cfg.schedule.total_steps or quit_now
        last_eval = self.totals.evals and self.totals.evals[-1][0] >= self.version
        if finished and self.inflight is None and not self._stop_sent and (last_eval or quit_now):
            self.save(final=True)  # the final checkpoint, before the other trainer processes stop
            if self.preempting:
                where = getattr(self.core.checkpoints, "directory", "nowhere")
                log.warning(
                    "stopped on request: version %d saved in %s; the same command resumes",
                    self.version,
                    where,
                )
            for a in range(self.cfg.actors):
                self.transport.send(f"actor:{a}", Stop())
            for f in self.cfg.followers:
                self.transport.send(f, Stop())
            self._stop_sent = True
        if self._stop_sent and self.reports.all_stopped:
            self.done = True

    def describe(self) -> str:
        return (
            f"learner: version {self.version}, step in flight: {self.inflight is not None}, "
            f"{self.queue.ready_groups()} groups ready ({self.groups_received} received, "
            f"{self.filter.filtered_total} filtered, {self.queue.dropped_groups} dropped as stale), "
            f"last eval {self.totals.evals[-1][0] if self.totals.evals else None}"
        )

    def elapsed(self) -> float:
        """Seconds since the start (evaluations run beside training, so their time counts)."""
        return self.clock.elapsed()

    @property
    def step_spans(self) -> list[tuple[int, float, float]]:
        """(version, dispatched, finished) of each train step, time.monotonic."""
        return self.clock.spans

    # ----- logging -----

    def _log_step(self, groups, m: dict, step_s: float, sync_s: float) -> dict[str, float]:
        st = staleness_stats(groups, self.version - 1)  # against the policy the batch was trained from
        elapsed = max(self.elapsed(), 1e-9)
        n_actors = max(len(self.reports.latest), 1)
        # Summed over the actors, idle seconds and the seconds of their own clocks at their last reports:
        # a report carries idle time from before the learner's window, so the learner's seconds are not
        # its denominator; per actor idle grows no faster than its clock, so the fraction stays <= 1
        # (an actor that had not reported yet counts from zero on both).
        sampler_idle_s, sampler_wall_s = self.reports.total("idle_s"), self.reports.total("wall_s")
        totals = {"train_tokens_per_s": float(self.totals.trained_tokens),
                  "sample_tokens_per_s": self.reports.total("sample_tokens"),
                  "sampler_idle_frac": sampler_idle_s, "sampler_wall_s": sampler_wall_s,
                  "trainer_idle_frac": self.clock.idle_s}  # fmt: skip
        values = {
            **train_values(m),
            **drift_values(m),
            "train/skipped_updates": float(np.asarray(self.core.state.skipped.addressable_shards[0].data)),
            **staleness_values(st, self.queue.dropped_groups),
            **self.filter.step_values(),
            **completion_values(groups),
            **rollout_values([r for g in groups for r in g]),  # multi-turn episodes only (env/)
            **tool_values([s.env for s in self.reports.latest.values() if s.env is not None]),
            **self.log.rates(elapsed, totals),
            "perf/slot_occupancy": self.reports.total("occupancy") / n_actors,
            "perf/weight_sync_s": sync_s,
            "perf/train_step_s": step_s,
            "rewards/errors": self.reports.total("reward_errors"),
            "perf/rejected_messages": float(self.transport.rejected),  # frames dropped by the hub
        }
        synced = getattr(self.core.publisher, "last_bytes", None)  # publishers that count (LoRA's)
        if synced is not None:
            values["perf/weight_sync_bytes"] = float(synced)
        times = {"time/elapsed_s": elapsed, "time/trained_tokens": float(self.totals.trained_tokens),
                 "time/trainer_idle_s": self.clock.idle_s,
                 "time/sampler_idle_s": sampler_idle_s, "time/sampler_wall_s": sampler_wall_s}  # fmt: skip
        return self.log.record(self.version, values, st, groups, times)

    def summary(self) -> dict[str, Any]:
        """The run's figures as the learner saw them (the orchestrator adds the other roles')."""
        hist, mean = self.log.history, self.log.mean
        train_wall = max(self.elapsed(), 1e-9)
        # When each version's weights existed: the end of its train step (version 0: the start).
        start = self.clock.started_mono
        trained = {0: 0.0, **{v: end - start for v, _, end in self.step_spans}}
        return {
            "steps": self.version,
            # seconds to the end of this run's first train step: start-up (compiling, the first evaluation,
            # the first batch) and one step
            "first_step_s": self.step_spans[0][2] - start if self.step_spans else None,
            "eval_s": self.totals.eval_s,
            "step_spans": list(self.step_spans),
            "train_tokens_per_s": self.totals.trained_tokens / train_wall,
            "steady_train_tokens_per_s": steady_rate(hist),
            "steady_sampler_idle_frac": steady_rate(hist, "time/sampler_idle_s", "time/sampler_wall_s"),
            "steady_trainer_idle_frac": steady_rate(hist, "time/trainer_idle_s"),
            "sample_tokens_per_s": self.reports.total("sample_tokens") / train_wall,
            "sampler_idle_frac": self.reports.total("idle_s") / max(self.reports.total("wall_s"), 1e-9),
            "trainer_idle_frac": self.clock.idle_s / train_wall,
            "staleness_mean": mean("staleness/mean"),
            "staleness_max": max((h.get("staleness/max", 0) for h in hist), default=0),
            "token_staleness_mean": mean("staleness/token_mean"),
            # per lag band: sampler/trainer mismatch (lag0) against staleness (docs/train.md, "Reading drift")
            "drift": drift_summary(hist),
            **self.log.length_quantiles(),
            "weight_sync_s_mean": mean("perf/weight_sync_s"),
            "train_step_s_mean": mean("perf/train_step_s"),
            # what the trainer pays per version, as a share of a train step (publish / step)
            "weight_sync_frac": mean("perf/weight_sync_s") / max(mean("perf/train_step_s"), 1e-9),
            "checkpoint_stall_s": self.totals.checkpoint_stall_s,
            "checkpoint_failures": self.core.checkpoints.failures if self.core.checkpoints is not None else 0,
            "preempted": self.preempting,
            "dropped_groups": self.queue.dropped_groups,
            "filtered_groups": self.filter.filtered_total,
            "stopped_no_signal": self.no_signal,
            "non_finite_steps": self.non_finite.total,
            "stopped_non_finite": self.non_finite.stop,
            "dropped_lengths": self.queue.dropped_lengths,
            "evals": [{"step": s, "accuracy": a, "elapsed_s": e, "trained_s": trained.get(s),
                       "expected_reward": x} for s, a, e, x in self.totals.evals],  # fmt: skip
            "final_accuracy": self.totals.evals[-1][1] if self.totals.evals else None,
            "initial_accuracy": self.totals.evals[0][1] if self.totals.evals else None,
            "weight_checksums": {"learner": self.totals.checksums,
                                 "actors": {i: s.checksums for i, s in self.reports.latest.items()}},
        }  # fmt: skip


def _ready(metrics: dict) -> bool:
    return all(v.is_ready() for v in jax.tree.leaves(metrics))


class Follower:
    """A trainer process other than the lead: runs the lead's steps on its share of the trainer mesh."""

    def __init__(self, core: TrainerCore, transport, process_id: int):
        self.core, self.transport = core, transport
        self.endpoint = f"trainer:{process_id}"
        self.done = False
        for _ in core.publish_all():  # the starting version, as the lead does
            pass

    def describe(self) -> str:
        return f"{self.endpoint}: version {self.core.version}"

    def poll(self) -> bool:
        messages = self.transport.recv(self.endpoint)
        for m in messages:
            if isinstance(m, TrainBatch):
                metrics, _ = self.core.dispatch(m.groups)
                jax.block_until_ready(metrics)
                if self.core.version == m.version:  # at least one update applied: a new version
                    for _ in self.core.publish_all():  # the lead's publishes, in its order
                        pass
            elif isinstance(m, SaveCheckpoint):
                self.core.save(m.coordinator_state or {}, m.metrics, m.wait)
            elif isinstance(m, Stop):
                self.done = True
            else:
                raise TypeError(f"{self.endpoint}: unexpected message {type(m).__name__}")
        return bool(messages)
