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

from jaxrl_async.rollouts import Rollout, RolloutQueue, staleness_stats
from jaxrl_async.runtime.metrics import MetricsWriter, summary_line
from jaxrl_async.runtime.transport import (
    EvalResult,
    Preempt,
    Rollouts,
    SaveCheckpoint,
    Stop,
    Stopped,
    TrainBatch,
    Trained,
)
from jaxrl_async.trainer import prepare_batch, train_step

log = logging.getLogger(__name__)

RATE_WINDOW = 10  # steps over which perf/* rates are taken (perf/*_avg: since the start)
_RATE_KEYS = ("train_tokens_per_s", "sample_tokens_per_s", "sampler_idle_frac", "trainer_idle_frac")

SUMMARY_KEYS = (
    "reward/mean",
    "eval/accuracy",
    "loss/policy",
    "staleness/mean",
    "staleness/max",
    "staleness/token_mean",
    "perf/train_tokens_per_s",
    "perf/weight_sync_s",
)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """What the learner needs to know of the run.

    Attributes:
      prompts_per_step: B, groups per train batch.
      samples_per_prompt: G.
      total_steps: versions to train.
      max_head_staleness: drop groups older than this when trained (None = off).
      log_every, text_samples, checkpoint_every, checkpoint_minutes: see configs/base.py.
      eval_every: versions between evaluations (actor 0 runs them beside sampling; the lead waits only
        for the last one, before stopping). Training never waits for an evaluation: a checkpoint due at
        an evaluated version carries its accuracy (for the best-checkpoint policy) only if that
        evaluation had finished; the final checkpoint always does.
      followers: endpoints of the other trainer processes.
      actors: number of actors.
      dynamic_sampling: discard groups whose rewards are all equal as they arrive (DAPO), so every batch
        holds `prompts_per_step` informative groups; the coordinator admits a new prompt for each.
      dynamic_sampling_patience: stop the run (saving first) once this many batches' worth of groups in
        a row were discarded: the policy solves (or fails) everything the data offers.
    """

    prompts_per_step: int
    samples_per_prompt: int
    total_steps: int
    max_head_staleness: int | None
    log_every: int
    text_samples: int
    checkpoint_every: int
    eval_every: int
    checkpoint_minutes: float = 0.0
    followers: tuple[str, ...] = ()
    actors: int = 1
    dynamic_sampling: bool = False
    dynamic_sampling_patience: int = 20


class TrainerCore:
    """What every trainer process holds: the train state, the step, the weight publisher, checkpoints."""

    def __init__(self, state, train_cfg, publisher, checkpoints):
        self.state, self.train_cfg, self.publisher, self.checkpoints = (
            state,
            train_cfg,
            publisher,
            checkpoints,
        )

    @property
    def version(self) -> int:
        return int(np.asarray(self.state.version.addressable_shards[0].data))

    def dispatch(self, groups: list[list[Rollout]]):
        """Starts one train step on `groups` (asynchronously); returns (metrics, zero-adv skipped count)."""
        rollouts = [r for g in groups for r in g]
        batch = prepare_batch(self.train_cfg, rollouts)
        self.state, metrics = train_step(self.state, batch)
        return metrics, batch.num_skipped

    def publish(self):
        """Offers the current weights to the actors; returns the `NewWeights` message."""
        return self.publisher.publish(self.version, self.state.params)

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


class Learner:
    """The learner lead (see the module docstring).

    Args:
      cfg: the learner's settings.
      core: the train state, step, publisher and checkpoints.
      transport: the run's transport; this role reads "learner".
      writer: TensorBoard (the lead is the run's only writer).
      coordinator_state: returns the coordinator's state for a checkpoint (same process, same thread).
    """

    endpoint = "learner"

    def __init__(self, cfg: LearnerConfig, core: TrainerCore, transport, writer: MetricsWriter,
                 coordinator_state: Callable[[], dict]):  # fmt: skip
        self.cfg, self.core, self.transport, self.writer = cfg, core, transport, writer
        self.coordinator_state = coordinator_state
        self.queue = RolloutQueue(cfg.samples_per_prompt, cfg.max_head_staleness)
        self.version = core.version
        self.start_version = self.version
        self.inflight: _InFlight | None = None
        self.actor_stats: dict[int, dict] = {}
        self.stopped: dict[str, dict] = {}
        self.evals: list[tuple[int, float, float]] = []  # (version, accuracy, elapsed)
        self.checksums: dict[int, float] = {}
        self.eval_s = 0.0
        self.trainer_idle_s = 0.0
        self.step_spans: list[tuple[int, float, float]] = []  # (version, dispatched, finished), monotonic
        self.trained_tokens = 0
        self.history: list[dict[str, float]] = []
        self.done = False
        self.data_exhausted = False
        self.preempting = False
        self.checkpoint_stall_s: list[float] = []
        self.filtered_groups = 0  # dynamic sampling: groups discarded (run total)
        self._kept_since = self._filtered_since = 0  # groups kept / discarded since the last step
        self._filtered_in_a_row = 0
        self.no_signal = False
        self._totals: list[tuple[float, dict]] = [(0.0, {k: 0.0 for k in _RATE_KEYS})]
        self._saved_at = time.monotonic()
        self._stop_sent = False
        self.t_start = time.perf_counter()
        self._idle_since = self.t_start
        self._publish()

    # ----- the event loop -----

    def poll(self) -> bool:
        progress = False
        for m in self.transport.recv(self.endpoint):
            progress = True
            if isinstance(m, Rollouts):
                self._take_groups(m.groups)
                self.actor_stats[m.actor] = m.stats
            elif isinstance(m, EvalResult):
                self._record_eval(m)
            elif isinstance(m, Stopped):
                self.stopped[m.endpoint] = m.stats
                self.actor_stats[int(m.endpoint.split(":")[1])] = m.stats
            elif isinstance(m, Preempt):
                self.preempt(f"process {m.process_id} got {m.signal}")
            else:
                raise TypeError(f"learner: unexpected message {type(m).__name__}")
        if self.inflight is not None and _ready(self.inflight.metrics):
            self._finish()
            progress = True
        busy = self.inflight is not None
        if not busy and not self.preempting and not self.no_signal and self.version < self.cfg.total_steps:
            groups = self.queue.pop_batch(self.cfg.prompts_per_step, self.version)
            self._report_drops()
            if groups is not None:
                self._dispatch(groups)
                progress = True
            elif self._all_drained():
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
        filtered = []
        for g in groups:
            if self.cfg.dynamic_sampling and _uninformative(g):
                filtered.append(g[0].group_id)
                self._filtered_in_a_row += 1
            else:
                self.queue.add_group(g)
                self._kept_since += 1
                self._filtered_in_a_row = 0
        if not filtered:
            return
        self.filtered_groups += len(filtered)
        self._filtered_since += len(filtered)
        self.transport.send("coordinator", Trained(self.version, [], filtered=filtered))
        for stats in self.actor_stats.values():
            stats["drained"] = False  # new work is coming
        limit = self.cfg.dynamic_sampling_patience * self.cfg.prompts_per_step
        if self._filtered_in_a_row >= limit and not self.no_signal:
            log.error(
                "dynamic sampling: the last %d groups all had equal rewards (trainer.dynamic_sampling_"
                "patience=%d batches); no learning signal is left, stopping at version %d",
                self._filtered_in_a_row, self.cfg.dynamic_sampling_patience, self.version,
            )  # fmt: skip
            self.no_signal = True

    def _report_drops(self) -> None:
        """Groups the queue dropped as too stale go back to the coordinator at once (started again)."""
        if self.queue.dropped_ids:
            self.transport.send("coordinator", Trained(self.version, [], self.queue.dropped_ids))
            self.queue.dropped_ids = []
            for stats in self.actor_stats.values():
                stats["drained"] = False  # new work is coming

    def _eval_of(self, version: int) -> float | None:
        return next((a for v, a, _ in reversed(self.evals) if v == version), None)

    def _all_drained(self) -> bool:
        stats = self.actor_stats
        return len(stats) == self.cfg.actors and all(s.get("drained") for s in stats.values())

    def _dispatch(self, groups) -> None:
        now = time.perf_counter()
        self.trainer_idle_s += now - self._idle_since
        for f in self.cfg.followers:
            self.transport.send(f, TrainBatch(self.version + 1, groups))
        metrics, skipped = self.core.dispatch(groups)
        self.inflight = _InFlight(groups, metrics, skipped, now)
        self._dispatched_at = time.monotonic()

    def _finish(self) -> None:
        step, self.inflight = self.inflight, None
        metrics = {k: float(np.asarray(v.addressable_shards[0].data)) for k, v in step.metrics.items()
                   if np.ndim(v) == 0}  # fmt: skip
        step_s = time.perf_counter() - step.started
        version = self.core.version
        if version == self.version:  # every update was skipped (non-finite): nothing new to publish
            self._idle_since = time.perf_counter()
            return
        self.version = version
        self.step_spans.append((version, self._dispatched_at, time.monotonic()))
        sync = self._publish()
        self._idle_since = time.perf_counter()
        rollouts = [r for g in step.groups for r in g]
        self.trained_tokens += sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rollouts)
        self.transport.send("coordinator", Trained(version, [g[0].group_id for g in step.groups]))
        metrics["zero_adv_skipped_frac"] = step.skipped / max(len(rollouts), 1)
        values = self._log_step(step.groups, metrics, step_s, sync)
        if self.version % self.cfg.log_every == 0:
            log.info(summary_line(self.version, values, SUMMARY_KEYS))
        if self.version < self.cfg.total_steps and self._save_due():
            self.save()  # at once: waiting for this version's evaluation would idle the trainer

    def _save_due(self) -> bool:
        every, minutes = self.cfg.checkpoint_every, self.cfg.checkpoint_minutes
        by_steps = bool(every and self.version % every == 0)
        return by_steps or bool(minutes and time.monotonic() - self._saved_at > 60 * minutes)

    def _publish(self) -> float:
        message = self.core.publish()
        if message.checksum is not None:
            self.checksums[message.version] = message.checksum
        for a in range(self.cfg.actors):
            self.transport.send(f"actor:{a}", message)
        return self.core.publisher.last_seconds

    def save(self, final: bool = False) -> None:
        """Checkpoints the train state with the coordinator's state, on every trainer process, with the
        version's held-out accuracy when known (the checkpoints keep the best one by it)."""
        state = self.coordinator_state()
        acc = self._eval_of(self.version)
        metrics = None if acc is None else {"eval_accuracy": acc}
        for f in self.cfg.followers:
            self.transport.send(f, SaveCheckpoint(self.version, state, metrics, final))
        held = self.core.save(state, metrics, wait=final)
        self.checkpoint_stall_s.append(held)
        self.writer.scalars(self.version, {"perf/checkpoint_stall_s": held})
        self._saved_at = time.monotonic()

    def _record_eval(self, m: EvalResult) -> None:
        self.eval_s += m.seconds
        elapsed = self.elapsed()
        self.evals.append((m.version, m.accuracy, elapsed))
        self.writer.scalars(m.version, {"eval/accuracy": m.accuracy})
        log.info("version %d: held-out accuracy %.3f", m.version, m.accuracy)

    def _maybe_stop(self) -> None:
        quit_now = self.data_exhausted or self.preempting or self.no_signal
        finished = self.version >= self.cfg.total_steps or quit_now
        last_eval = self.evals and self.evals[-1][0] >= self.version
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
        if self._stop_sent and len(self.stopped) == self.cfg.actors:
            self.done = True

    def describe(self) -> str:
        return (
            f"learner: version {self.version}, step in flight: {self.inflight is not None}, "
            f"{self.queue.ready_groups()} groups ready, last eval {self.evals[-1][0] if self.evals else None}"
        )

    def elapsed(self) -> float:
        """Seconds since the start (evaluations run beside training, so their time counts)."""
        return time.perf_counter() - self.t_start

    # ----- logging -----

    def _actor_sum(self, key: str) -> float:
        return float(sum(s.get(key, 0.0) for s in self.actor_stats.values()))

    def _rates(self, elapsed: float, n_actors: int) -> dict[str, float]:
        """perf/* rates over the last RATE_WINDOW steps (what the run does now), and since the start as
        perf/*_avg (the run average climbs for a while after compilation and hides later slowdowns)."""
        totals = {
            "train_tokens_per_s": float(self.trained_tokens),
            "sample_tokens_per_s": self._actor_sum("sample_tokens"),
            "sampler_idle_frac": self._actor_sum("idle_s") / n_actors,
            "trainer_idle_frac": self.trainer_idle_s,
        }
        self._totals.append((elapsed, totals))
        t0, start = self._totals[max(0, len(self._totals) - 1 - RATE_WINDOW)]
        out = {}
        for k, v in totals.items():
            out[f"perf/{k}"] = (
                (v - start[k]) / max(elapsed - t0, 1e-9) if len(self._totals) > 1 else v / elapsed
            )
            out[f"perf/{k}_avg"] = v / elapsed
        return out

    def _log_step(self, groups, m: dict, step_s: float, sync_s: float) -> dict[str, float]:
        st = staleness_stats(groups, self.version - 1)  # against the policy the batch was trained from
        rollouts = [r for g in groups for r in g]
        lengths = [len(r.completion_tokens) for r in rollouts]
        elapsed = max(self.elapsed(), 1e-9)
        n_actors = max(len(self.actor_stats), 1)
        values = {
            "reward/mean": float(np.mean([r.reward for r in rollouts])),
            "loss/policy": m.get("loss"),
            "is_weight/mean": m.get("is_weight_mean"),
            "is_weight/max": m.get("is_weight_max"),
            "train/clip_frac": m.get("clip_frac"),
            "train/clip_low_frac": m.get("clip_low_frac"),
            "train/clip_high_frac": m.get("clip_high_frac"),
            "train/dual_clip_frac": m.get("dual_clip_frac"),
            "train/behav_dropped_frac": m.get("behav_dropped_frac"),
            "train/kl_ref": m.get("kl_ref_mean"),
            "train/kl_behav": m.get("kl_behav_mean"),
            "train/grad_norm": m.get("grad_norm"),
            "train/entropy": m.get("entropy_mean"),
            "train/skipped_updates": float(np.asarray(self.core.state.skipped.addressable_shards[0].data)),
            "train/zero_adv_skipped_frac": m.get("zero_adv_skipped_frac"),
            "staleness/mean": st["head_mean"],
            "staleness/max": float(st["head_max"]),
            "staleness/token_mean": st["token_mean"],
            "staleness/token_max": float(st["token_max"]),
            "staleness/dropped_groups": float(self.queue.dropped_groups),
            **self._dynamic_sampling_values(),
            "reward/overlong_penalty": float(np.mean([r.metadata.get("overlong_penalty", 0.0)
                                                      for r in rollouts])),  # fmt: skip
            "completion/truncated_frac": float(np.mean([r.finish_reason == "length" for r in rollouts])),
            "train/uninformative_group_frac": float(np.mean([_uninformative(g) for g in groups])),
            "completion/length_mean": float(np.mean(lengths)),
            "completion/length_max": float(np.max(lengths)),
            **self._rates(elapsed, n_actors),
            "perf/slot_occupancy": self._actor_sum("occupancy") / n_actors,
            "perf/weight_sync_s": sync_s,
            "perf/train_step_s": step_s,
            "rewards/errors": self._actor_sum("reward_errors"),
        }
        w = self.writer
        w.scalars(self.version, values)
        w.histogram(self.version, "staleness/head", st["head_values"])
        w.histogram(self.version, "staleness/token", st["token_values"])
        w.histogram(self.version, "completion/length", lengths)
        for r in rollouts[: self.cfg.text_samples]:
            w.text(
                self.version,
                "samples",
                f"reward {r.reward:.2f} | {r.metadata['prompt']!r} -> {r.metadata['text']!r}",
            )
        values["time/elapsed_s"] = elapsed
        values["time/trained_tokens"] = float(self.trained_tokens)
        values["time/trainer_idle_s"] = self.trainer_idle_s
        values["time/sampler_idle_s"] = self._actor_sum("idle_s") / n_actors
        self.history.append({k: v for k, v in values.items() if v is not None})
        return values

    def _dynamic_sampling_values(self) -> dict[str, float]:
        """Yield (groups kept / groups finished since the last step) and the run's discarded total."""
        if not self.cfg.dynamic_sampling:
            return {}
        seen = self._kept_since + self._filtered_since
        values = {
            "dynamic_sampling/yield": self._kept_since / seen if seen else 1.0,
            "dynamic_sampling/filtered_groups": float(self.filtered_groups),
        }
        self._kept_since = self._filtered_since = 0
        return values

    def summary(self) -> dict[str, Any]:
        """The run's figures as the learner saw them (the orchestrator adds the other roles')."""
        hist = self.history
        mean = lambda k: float(np.mean([h[k] for h in hist if k in h])) if hist else 0.0
        train_wall = max(self.elapsed(), 1e-9)
        actors = self.actor_stats.values()
        return {
            "steps": self.version,
            "eval_s": self.eval_s,
            "step_spans": list(self.step_spans),
            "train_tokens_per_s": self.trained_tokens / train_wall,
            "steady_train_tokens_per_s": steady_rate(hist),
            "steady_sampler_idle_frac": steady_rate(hist, "time/sampler_idle_s"),
            "steady_trainer_idle_frac": steady_rate(hist, "time/trainer_idle_s"),
            "sample_tokens_per_s": self._actor_sum("sample_tokens") / train_wall,
            "sampler_idle_frac": self._actor_sum("idle_s") / max(len(actors), 1) / train_wall,
            "trainer_idle_frac": self.trainer_idle_s / train_wall,
            "staleness_mean": mean("staleness/mean"),
            "staleness_max": max((h.get("staleness/max", 0) for h in hist), default=0),
            "token_staleness_mean": mean("staleness/token_mean"),
            "weight_sync_s_mean": mean("perf/weight_sync_s"),
            "checkpoint_stall_s": self.checkpoint_stall_s,
            "preempted": self.preempting,
            "dropped_groups": self.queue.dropped_groups,
            "filtered_groups": self.filtered_groups,
            "stopped_no_signal": self.no_signal,
            "dropped_lengths": self.queue.dropped_lengths,
            "evals": [{"step": s, "accuracy": a, "elapsed_s": e} for s, a, e in self.evals],
            "final_accuracy": self.evals[-1][1] if self.evals else None,
            "initial_accuracy": self.evals[0][1] if self.evals else None,
            "weight_checksums": {"learner": self.checksums,
                                 "actors": {i: s.get("checksums", {}) for i, s in self.actor_stats.items()}},
        }  # fmt: skip


def steady_rate(hist: list[dict[str, float]], key: str = "time/trained_tokens") -> float:
    """Growth of `key` per second after the first fifth of the steps (at least 2), which excludes
    compilation and fill-up: trained tokens/s, or with an idle-seconds key the idle fraction."""
    k = max(2, len(hist) // 5)
    if len(hist) <= k:
        return 0.0
    a, b = hist[k - 1], hist[-1]
    return (b[key] - a[key]) / max(b["time/elapsed_s"] - a["time/elapsed_s"], 1e-9)


def _uninformative(group: list[Rollout]) -> bool:
    """All rewards equal: group-relative advantages are 0, so the group carries no policy gradient."""
    rewards = [r.reward for r in group]
    return max(rewards) - min(rewards) <= 1e-8


def _ready(metrics: dict) -> bool:
    return all(v.is_ready() for v in jax.tree.leaves(metrics))


class Follower:
    """A trainer process other than the lead: runs the lead's steps on its share of the trainer mesh."""

    def __init__(self, core: TrainerCore, transport, process_id: int):
        self.core, self.transport = core, transport
        self.endpoint = f"trainer:{process_id}"
        self.done = False
        core.publish()  # the starting version, as the lead does

    def describe(self) -> str:
        return f"{self.endpoint}: version {self.core.version}"

    def poll(self) -> bool:
        messages = self.transport.recv(self.endpoint)
        for m in messages:
            if isinstance(m, TrainBatch):
                metrics, _ = self.core.dispatch(m.groups)
                jax.block_until_ready(metrics)
                if self.core.version == m.version:  # at least one update applied: a new version
                    self.core.publish()
            elif isinstance(m, SaveCheckpoint):
                self.core.save(m.coordinator_state or {}, m.metrics, m.wait)
            elif isinstance(m, Stop):
                self.done = True
            else:
                raise TypeError(f"{self.endpoint}: unexpected message {type(m).__name__}")
        return bool(messages)
