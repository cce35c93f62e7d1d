"""TensorBoard event files (tensorboardX, no TensorFlow needed) and a one-line step summary."""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np

from jaxrl_async import storage

# Scalar tags every run writes (README "Configs"); tests and benchmarks/device_check.sh check for them.
SCALAR_TAGS = (
    "eval/accuracy",
    "reward/mean",
    "staleness/mean",
    "staleness/max",
    "staleness/token_mean",
    "perf/train_tokens_per_s",
    "perf/train_tokens_per_s_avg",
    "perf/sample_tokens_per_s",
    "perf/sampler_idle_frac",
    "perf/trainer_idle_frac",
    "perf/weight_sync_s",
    "perf/rejected_messages",
    "loss/policy",
    "is_weight/mean",
    "train/clip_frac",
    "train/clip_low_frac",
    "train/clip_high_frac",
    "train/dual_clip_frac",
    "train/behav_dropped_frac",
    "train/kl_behav",
    "train/updates",
    "train/ess",
    "train/uninformative_group_frac",
    "reward/overlong_penalty",
    "completion/truncated_frac",
)
# Written at every step of a multi-turn run (config.env.enabled; docs/environments.md documents them, with
# the env/tool_errors/<kind> and env/ends/<reason> tags that appear once such an error or ending has).
ENV_TAGS = (
    "env/episodes",
    "env/turns_per_episode",
    "env/observation_token_fraction",
    "env/tool_calls",
    "env/tool_errors",
    "env/tool_timeouts",
    "env/tool_outputs_cleaned",
    "env/tool_threads_abandoned",
    "env/env_errors",
    "env/parked_slot_fraction",
)
# Written only when their feature is on: train/kl_ref (trainer.kl_coef > 0), dynamic_sampling/yield and
# dynamic_sampling/filtered_groups (trainer.dynamic_sampling), eval/expected_reward and its _stderr (an
# exact-match task sampled without top-k/top-p, runtime/expected_reward.py), train/adapter_norm
# (trainer.lora), perf/weight_sync_bytes (a publisher that counts its bytes: each of runtime/weight_sync.py's
# and runtime/lora_sync.py's does).


class MetricsWriter:
    """Writes scalars, histograms and text under `workdir/tb` (process 0 only).

    A bucket workdir (gs://...): the event file is written in a local staging folder (the writer appends,
    an object store cannot) and copied to `workdir/tb` at most every `sync_s` seconds while scalars come
    in, and on `flush` and `close`; a run killed in between loses at most `sync_s` of TensorBoard history.
    """

    def __init__(self, workdir: str, enabled: bool = True, sync_s: float = 60.0):
        self.enabled = enabled
        self._writer = None
        self.sync_s, self._synced = sync_s, time.monotonic()
        if enabled:
            from tensorboardX import SummaryWriter

            self.logdir = storage.join(workdir, "tb")
            self._staged = storage.StagedDir(self.logdir)
            self._writer = SummaryWriter(self._staged.local, flush_secs=10)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if not self._writer:
            return
        for tag, v in values.items():
            if v is not None and np.isfinite(v):
                self._writer.add_scalar(tag, float(v), step)
        if self._staged.remote and time.monotonic() - self._synced > self.sync_s:
            self.flush()

    def histogram(self, step: int, tag: str, values) -> None:
        values = np.asarray(values)
        if self._writer and values.size:
            self._writer.add_histogram(tag, values, step, bins="auto")

    def text(self, step: int, tag: str, text: str) -> None:
        if self._writer:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        """Writes out what is buffered (and copies it to the bucket, for a bucket workdir)."""
        if self._writer:
            self._writer.flush()
            self._staged.sync()
            self._synced = time.monotonic()

    def close(self) -> None:
        if self._writer:
            self._writer.close()
            self._writer = None
            self._staged.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalar series of an event directory (for tests, tools and the performance model)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def summary_line(step: int, values: Mapping[str, float], keys: tuple[str, ...]) -> str:
    """`step 12 | reward/mean 0.61 | ...` for the keys present."""
    parts = [f"step {step}"]
    for k in keys:
        if k in values and values[k] is not None:
            v = values[k]
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
    return " | ".join(parts)


class IdleClock:
    """A role's idle time: wall time of rounds that had nothing to do (the actor's "nothing to decode or
    grade"), whatever its loop did meanwhile, counted from the first idle round to the next busy one."""

    def __init__(self):
        self.started = time.perf_counter()  # the clock of `wall_s`
        self._idle_s = 0.0
        self._since: float | None = None

    def round(self, t0: float, busy: bool) -> None:
        """Accounts for a round that began at `t0` (perf_counter) and was busy or not."""
        if busy and self._since is not None:
            self._idle_s += t0 - self._since
            self._since = None
        elif not busy and self._since is None:
            self._since = t0

    def idle_s(self, now: float) -> float:
        return self._idle_s + (now - self._since if self._since is not None else 0.0)

    def wall_s(self, now: float) -> float:
        return now - self.started

